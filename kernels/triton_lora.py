"""Triton kernels for the grouped LoRA product of kernels/lora.py (same signature; see that
module's docstring): out[tokens] += (x[tokens] @ A^T) @ B^T, in place.

Two launches, as Punica's and vLLM's shrink / expand kernels: shrink gathers a [BLOCK_M] tile of
the group's token rows of x and multiplies it by A^T into an fp32 [G, R] buffer (the rank R is at
most a few hundred: an adapter's ranks of a fused linear stacked); expand multiplies that buffer
by B^T tile by tile and adds each result to out's rows at the same token indices (distinct rows:
no two programs write one element). The tokens are gathered inside the kernels, so the group's
rows of x are never copied out. Tiles are untuned defaults (the development machines have no
GPU); every load is masked, so any G, K, R and N are correct.

Importing this module needs triton; on CPU tensors it runs in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_kernels import _cast, _dot, _span

BLOCK_M = 16
BLOCK_R = 16
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _group_rows(tok_ptr, G, BLOCK_M: tl.constexpr):
    """This program's BLOCK_M rows of the group, which of them exist, and their tokens (int64):
    the gather both launches start with."""
    rows, row_ok = _span(tl.program_id(0) * BLOCK_M, BLOCK_M, G)
    tokens = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    return rows, row_ok, tokens


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, tok_ptr, tmp_ptr,
    G, K, R,
    stride_x, stride_a, stride_t,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows, row_ok, tokens = _group_rows(tok_ptr, G, BLOCK_M)
    ranks, rank_ok = _span(tl.program_id(1) * BLOCK_R, BLOCK_R, R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks, k_ok = _span(k0, BLOCK_K, K)
        x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # A^T tile: [BLOCK_K, BLOCK_R], element (k, r) = A[r, k]
        a = tl.load(a_ptr + ranks[None, :].to(tl.int64) * stride_a + ks[:, None],
                    mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
        acc += _dot(x, a, IEEE)
    tl.store(tmp_ptr + rows[:, None].to(tl.int64) * stride_t + ranks[None, :], acc,
             mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _expand_kernel(
    tmp_ptr, b_ptr, tok_ptr, out_ptr,
    G, R, N,
    stride_t, stride_b, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows, row_ok, tokens = _group_rows(tok_ptr, G, BLOCK_M)
    cols, col_ok = _span(tl.program_id(1) * BLOCK_N, BLOCK_N, N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs, r_ok = _span(r0, BLOCK_R, R)
        t = tl.load(tmp_ptr + rows[:, None].to(tl.int64) * stride_t + rs[None, :],
                    mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        # B^T tile: [BLOCK_R, BLOCK_N], element (r, n) = B[n, r], in fp32 as the buffer is
        b = tl.load(b_ptr + cols[None, :].to(tl.int64) * stride_b + rs[:, None],
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(t, b, input_precision="ieee")
    where = out_ptr + tokens[:, None] * stride_o + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    current = tl.load(where, mask=mask, other=0.0).to(tl.float32)
    tl.store(where, _cast(current + acc, out_ptr.dtype.element_ty), mask=mask)


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor) -> None:
    g, k = tokens.shape[0], x.shape[1]
    r, n = a.shape[0], b.shape[0]
    if not g or not r:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    a, b, tokens = a.contiguous(), b.contiguous(), tokens.contiguous()
    tmp = torch.empty(g, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(triton.cdiv(g, BLOCK_M), triton.cdiv(r, BLOCK_R))](
        x, a, tokens, tmp, g, k, r, x.stride(0), a.stride(0), tmp.stride(0),
        IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )
    _expand_kernel[(triton.cdiv(g, BLOCK_M), triton.cdiv(n, BLOCK_N))](
        tmp, b, tokens, out, g, r, n, tmp.stride(0), b.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
    )
