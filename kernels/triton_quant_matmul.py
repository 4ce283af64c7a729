"""Triton kernel for the weight-only quantized matmul of kernels/quant_matmul.py
(same signature, same weight format; see that module's docstring).

One program computes a [BLOCK_M, BLOCK_N] tile of the output: it walks K in
BLOCK_K steps, loads the x tile and the matching packed weight tile, unpacks
the 4-bit values (or reads the int8 ones), applies each column's group scale
and offset in fp32, rounds the weights to x's dtype (as the reference's
dequantize-then-F.linear does) and accumulates a tl.dot in fp32. Only the
packed weights cross memory, which is the point at decode, where the matmul
is bandwidth-bound: 4-bit weights move an eighth of fp32's bytes.

Tiles: decode-sized batches (M <= 16) take BLOCK_M = 16 (tl.dot's minimum)
and wide K steps, larger ones square-ish tiles. These are untuned defaults
(the development machines have no GPU), chosen after gpt-fast's and vLLM's
Triton weight-only kernels. Every load is masked and each column's scale is
gathered by its own group index, so any shape and any group size dividing K
is correct, whatever the tile sizes.

Importing this module needs triton; on CPU tensors it runs in Triton's
interpreter (TRITON_INTERPRET=1 set before this module is imported), where two
bf16 shortcomings are worked around by kernels/triton_kernels.py's _cast and _dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_kernels import _cast, _dot, _span


@triton.jit
def _quant_matmul_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows, row_ok = _span(tl.program_id(0) * BLOCK_M, BLOCK_M, M)
    cols, col_ok = _span(tl.program_id(1) * BLOCK_N, BLOCK_N, N)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks, k_ok = _span(k0, BLOCK_K, K)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        # the weight tile transposed: [BLOCK_K, BLOCK_N], element (k, n) = W[n, k]
        if BITS == 4:
            byte = tl.load(q_ptr + cols64[None, :] * stride_qn + (ks // 2)[:, None], mask=w_ok, other=0)
            q = (byte.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 0xF
        else:
            q = tl.load(q_ptr + cols64[None, :] * stride_qn + ks[:, None], mask=w_ok, other=0).to(tl.int32)
        group = (ks // GROUP)[:, None]
        w = q.to(tl.float32) * tl.load(s_ptr + cols64[None, :] * stride_sn + group, mask=w_ok, other=0.0)
        if HAS_OFFSETS:
            w = w + tl.load(o_ptr + cols64[None, :] * stride_sn + group, mask=w_ok, other=0.0)
        w = _cast(w, x_ptr.dtype.element_ty)
        acc += _dot(x, w, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = _cast(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    k = x.shape[-1]
    n = qweight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    scales = scales.contiguous()
    offsets = offsets.contiguous() if offsets is not None else None
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, block_k = (16, 64, 128) if m <= 16 else (64, 64, 64)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _quant_matmul_kernel[grid](
            x2, qweight, scales, offsets if offsets is not None else scales, bias if bias is not None else scales,
            out, m, n, k,
            x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
            GROUP=group_size, BITS=bits, HAS_OFFSETS=offsets is not None, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )
    return out.reshape(*x.shape[:-1], n)
