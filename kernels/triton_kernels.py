"""Triton implementations of every kernel in kernels/reference.py, with the
same signatures and the same paged layout (see that module's docstring).

Importing this module needs triton. On a machine without a GPU the kernels
run in Triton's interpreter (TRITON_INTERPRET=1, which must be set before
this module is imported: @triton.jit reads it); kernels/dispatch.py arranges
that when the Triton path is forced on CPU tensors. The functions here are
the Triton implementations of the genq:: operators (kernels/ops.py).

Design (after vLLM's unified Triton attention and flash-decoding):

- paged_attention is one kernel, `_paged_attention_kernel`, over a grid of
  (query block, KV head, KV split). A query block holds BLOCK_Q consecutive
  query tokens of ONE sequence times the G query heads sharing a KV head
  (GQA grouping: the K/V tiles are loaded once for all G heads), flattened
  into BLOCK_M = BLOCK_Q * next_pow2(G) rows of a tl.dot. The program walks
  the sequence's context in BLOCK_N-token tiles, reading K/V through the page
  table one token row at a time (so any page size works, and a tile may span
  pages), with an online softmax in fp32. Query token i of sequence b sits at
  position context_lens[b] - q_len + i and sees keys <= its position (and
  > position - sliding_window), which covers chunked prefill, prefix-cache
  hits and decode rows with one code path. With a soft-cap c (Gemma 2) each
  tile's scaled scores become c * tanh(score / c) before the softmax.
- Decode-only steps (T == B, known from shapes, no device sync) use one
  query token per block and split the context across NUM_SPLITS programs
  (flash-decoding); each writes a partial output and its log-sum-exp, and
  `_merge_splits_kernel` combines them. Steps with prefill rows use one split
  (their query blocks already fill the GPU).
- The query-block -> sequence mapping is found in the kernel by a binary
  search over cu_seqlens_q (as vLLM does), so no host sync is needed.
- Accumulation is fp32 throughout; fp32 inputs use IEEE dot products (no TF32)
  so the kernels match the reference to 1e-5.
- Quantized caches (kernels/kv_quant.py): `_write_kv_quant_kernel` quantizes
  each (token, head) vector into its slot and scales, bit-identical to the
  torch reference; `_paged_attention_kernel` dequantizes each K/V tile
  (fp32) right after its load. K and V each have their own format
  (constexprs K_FORMAT / V_FORMAT: "k8v4" is q8 keys and q4 values); a
  full-precision cache is the _FLOAT format, whose scale pointer and
  strides are passed but never read. The Hadamard rotation of
  fp8 is applied around the kernels (kv_quant.rotate), as the
  reference does: to K / V before the write kernel quantizes them, to q when
  K is rotated and to the output when V is.
- fp8 (e4m3fn) travels through the kernels as its uint8 bit pattern, encoded
  and decoded by hand (`_fp8_to_float`, `_float_to_fp8`): Triton's
  interpreter casts to fp8 rounding half away from zero and flushing
  subnormals (torch rounds to nearest even), and the decode, a shift into
  fp16 and one multiply, needs no fp8 hardware (it runs on Ampere too).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_quant import SCALE_MAX, SCALE_MIN, KVFormat, paged_formats, rotate

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Two of the interpreter's bf16 shortcomings are worked around under it (and
# only there): it truncates fp32 -> bf16 casts where the GPU rounds to nearest
# even (as torch does), so `_cast` rounds by hand; and its tl.dot multiplies
# bf16 operands as raw integers, so `_dot` feeds it fp32.
_INTERPRETER_WORKAROUNDS = tl.constexpr(_INTERPRET)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """x.to(dtype) with round-to-nearest-even, on the GPU and in the interpreter."""
    if _INTERPRETER_WORKAROUNDS and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """tl.dot with fp32 accumulation. The interpreter multiplies bf16 operands
    as their raw uint16 bits, so there they go in as fp32 (exact: a bf16 x bf16
    product fits fp32), which is what the GPU's tensor cores compute too."""
    if _INTERPRETER_WORKAROUNDS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _span(start, BLOCK: tl.constexpr, limit):
    """The BLOCK offsets from start and which of them are below limit: every tiled kernel's
    row / column / K-step preamble, written once."""
    offsets = start + tl.arange(0, BLOCK)
    return offsets, offsets < limit


@triton.jit
def _tanh(x):
    """tanh from exp (no tanh in tl, and this runs in the interpreter too);
    exp of a non-positive argument never overflows."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (fp32) rounded to dtype's precision and kept in fp32: reproduces the
    rounding of a torch op computed in dtype."""
    return _cast(x, dtype).to(tl.float32)


def _row_view(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as a 2-D [rows, width] view with unit stride along width (copying
    only if it cannot be viewed that way)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, width)
    except RuntimeError:
        return x.reshape(-1, width)


def _block(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# --------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # the sum is rounded to the activation dtype, as the reference's x + residual is
        x = _cast(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        # Gemma: (1 + weight) applied in fp32, one rounding at the end
        y = x32 * (1.0 / tl.sqrt(var + eps)) * (1.0 + w)
    else:
        normed = _cast(x32 * (1.0 / tl.sqrt(var + eps)), x_ptr.dtype.element_ty)
        y = w * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, _cast(y, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = _row_view(x, n)
    out_dtype = x.dtype if unit_offset else torch.result_type(weight, x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, n)
    res_out = res2 = res_out2 = None
    if residual is not None:
        res2 = _row_view(residual.to(x.dtype), n)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out2 = res_out.view(-1, n)
    rows = x2.shape[0]
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, res2 if res2 is not None else x2, weight.contiguous(), out2,
            res_out2 if res_out2 is not None else out2,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, out2.stride(0),
            res_out2.stride(0) if res_out2 is not None else 0,
            n, float(eps),
            HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=_block(n),
        )
    return out, res_out


# --------------------------------------------------------------------------- activation * mul


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols, mask = _span(tl.program_id(1) * BLOCK, BLOCK, n_cols)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    if GELU_TANH:
        act = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # the activation rounded to the activation dtype before the product, as F.silu(gate) * up does
    act = _cast(act, out_ptr.dtype.element_ty)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, _cast(y, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(gate_up, gelu_tanh=True)


def _act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    width = gate_up.shape[-1]
    inter = width // 2
    x2 = _row_view(gate_up, width)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    out2 = out.view(-1, inter)
    block = min(_block(inter), 1024)
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, x2.stride(0), out2.stride(0), inter, GELU_TANH=gelu_tanh, BLOCK=block
        )
    return out


# --------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh, stride_ct, stride_st,
    num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    mask = (heads[:, None] < num_heads) & dmask[None, :]
    dtype = x_ptr.dtype.element_ty
    # cos/sin are cast to the activation dtype first, as the reference does
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + half + d, mask=dmask, other=0.0).to(tl.float32)
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    c1, c2, s1, s2 = _round(c1, dtype), _round(c2, dtype), _round(s1, dtype), _round(s2, dtype)
    # each product and the sum rounded to the activation dtype, as the reference's
    # x * cos + rotate_half(x) * sin (and Hugging Face's) are
    y1 = _round(x1 * c1[None, :], dtype) + _round(-x2 * s1[None, :], dtype)
    y2 = _round(x2 * c2[None, :], dtype) + _round(x1 * s2[None, :], dtype)
    tl.store(base, _cast(y1, dtype), mask=mask)
    tl.store(base + half, _cast(y2, dtype), mask=mask)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens = q.shape[0]
    if tokens == 0:
        return
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    half = cos.shape[-1] // 2
    for x in (q, k):
        if x.stride(-1) != 1:
            raise ValueError("apply_rope needs a unit stride along head_dim (it rotates in place)")
        _rope_kernel[(tokens,)](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), x.shape[1], half,
            BLOCK_H=_block(x.shape[1]), BLOCK_HALF=_block(half),
        )


# --------------------------------------------------------------------------- KV write


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_h, stride_kc_s, stride_vc_h, stride_vc_s,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slots mark padding tokens (vLLM's convention); skip them
        d = tl.arange(0, BLOCK_D)
        mask = d < head_dim
        kv = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(k_cache_ptr + h * stride_kc_h + slot * stride_kc_s + d, _cast(kv, k_cache_ptr.dtype.element_ty),
                 mask=mask)
        vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + h * stride_vc_h + slot * stride_vc_s + d, _cast(vv, v_cache_ptr.dtype.element_ty),
                 mask=mask)


def _slot_stride(cache: torch.Tensor) -> int:
    """Stride between consecutive slots of one head: needs the (page, offset)
    dims to be one run and head_dim contiguous."""
    if cache.stride(3) != 1 or cache.stride(1) != cache.shape[2] * cache.stride(2):
        raise ValueError("KV cache must be [heads, pages, page_size, head_dim] with contiguous pages")
    return cache.stride(2)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    tokens, num_kv_heads, head_dim = k.shape
    k_fmt, v_fmt = paged_formats(k_cache, v_cache, k_scales, v_scales, head_dim)
    if tokens == 0:
        return
    # fp8 quantizes the rotated vectors (fp32, exactly as the reference rotates them)
    k = rotate(k.float(), k_fmt) if k_fmt.rotated else k
    v = rotate(v.float(), v_fmt) if v_fmt.rotated else v
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if not k_fmt.quantized and not v_fmt.quantized:
        _write_kv_kernel[(tokens, num_kv_heads)](
            k, v, k_cache, v_cache, slot_mapping.contiguous(),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), _slot_stride(k_cache), v_cache.stride(0), _slot_stride(v_cache),
            head_dim, BLOCK_D=_block(head_dim),
        )
        return
    ks, vs = _scale_strides(k_scales), _scale_strides(v_scales)
    kf, vf = _format_constexprs(k_fmt), _format_constexprs(v_fmt)
    _write_kv_quant_kernel[(tokens, num_kv_heads)](
        k, v, _kernel_view(k_cache), _kernel_view(v_cache),
        k_scales if k_scales is not None else k_cache, v_scales if v_scales is not None else v_cache,
        slot_mapping.contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), _slot_stride(k_cache), v_cache.stride(0), _slot_stride(v_cache),
        ks[0], ks[2], vs[0], vs[2],
        head_dim,
        K_FORMAT=kf[0], K_GROUP=kf[1], K_BLOCK_G=kf[2], K_BLOCK_J=kf[3], K_QMAX=kf[4],
        V_FORMAT=vf[0], V_GROUP=vf[1], V_BLOCK_G=vf[2], V_BLOCK_J=vf[3], V_QMAX=vf[4],
        SCALE_LO=SCALE_MIN, SCALE_HI=SCALE_MAX,
    )


# --------------------------------------------------------------------------- quantized KV

# KV_FORMAT constexpr values
_FLOAT = tl.constexpr(0)
_FP8 = tl.constexpr(1)
_Q8 = tl.constexpr(2)
_Q4 = tl.constexpr(3)
_FORMAT_IDS = {"auto": 0, "fp8": 1, "q8": 2, "q4": 3}


@triton.jit
def _fp8_to_float(bits):
    """e4m3fn bit patterns (uint8) -> fp32, exactly: the exponent and mantissa
    bits shifted into place are an fp16 that is the value / 256 (e4m3's
    subnormals land on fp16's subnormals, so they decode too)."""
    b = bits.to(tl.int32)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _float_to_fp8(y):
    """fp32 in [-448, 448] -> e4m3fn bit patterns (uint8), rounding to nearest
    even as torch does; exact fp32 and integer arithmetic only."""
    bits = y.to(tl.uint32, bitcast=True)
    a = tl.abs(y)
    # normal range: keep 3 mantissa bits (round half to even on the bits)
    a_bits = a.to(tl.uint32, bitcast=True)
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal range (< 2^-6): multiples of 2^-9, rounded half to even
    m = a * 512.0
    whole = tl.floor(m)
    frac = m - whole
    odd = (whole.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    sub = tl.where(up, whole + 1.0, whole) * 0.001953125
    r = tl.where(a < 0.015625, sub, normal)
    # on the e4m3 grid, r / 256 is an exact fp16 whose bits shift back into e4m3's
    half = (r * 0.00390625).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    return (((half >> 7) & 0x7F) | ((bits >> 24) & 0x80).to(tl.int32)).to(tl.uint8)


@triton.jit
def _quantize_store(
    x_row, data_row, scale_row, head_dim,
    KV_FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr,
    QMAX: tl.constexpr, SCALE_LO: tl.constexpr, SCALE_HI: tl.constexpr,
):
    """Quantize one head vector (head_dim values at x_row) into its slot:
    data at data_row, one float16 scale per GROUP values at scale_row. Works
    on a [groups, values] tile; q4 loads a group's even and odd elements as
    two tiles, which are the low and high nibbles of its bytes. A float cache
    (_FLOAT; BLOCK_J >= head_dim) gets the values cast to its dtype, no scales."""
    num_groups = head_dim // GROUP
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_J)
    if KV_FORMAT == _FLOAT:
        x = tl.load(x_row + j, mask=j < head_dim, other=0.0)
        tl.store(data_row + j, _cast(x, data_row.dtype.element_ty), mask=j < head_dim)
    elif KV_FORMAT == _Q4:
        # asymmetric: a minimum and a scale per group, levels 0..QMAX; even and odd elements are the
        # low and high nibbles of the group's bytes
        mask = (g[:, None] < num_groups) & (j[None, :] < GROUP // 2)
        offs = g[:, None] * GROUP + 2 * j[None, :]
        lo = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(x_row + offs + 1, mask=mask, other=0.0).to(tl.float32)
        low = tl.minimum(tl.min(tl.where(mask, lo, float("inf")), axis=1),
                         tl.min(tl.where(mask, hi, float("inf")), axis=1))
        high = tl.maximum(tl.max(tl.where(mask, lo, float("-inf")), axis=1),
                          tl.max(tl.where(mask, hi, float("-inf")), axis=1))
        low = tl.where(g < num_groups, low, 0.0)
        high = tl.where(g < num_groups, high, 0.0)
        minimum = tl.minimum(tl.maximum(low, -SCALE_HI), SCALE_HI).to(tl.float16)
        scale = tl.minimum(tl.maximum(tl.math.div_rn(high - low, QMAX), SCALE_LO), SCALE_HI).to(tl.float16)
        tl.store(scale_row + g, scale, mask=g < num_groups)
        tl.store(scale_row + num_groups + g, minimum, mask=g < num_groups)
        s = scale.to(tl.float32)[:, None]
        m = minimum.to(tl.float32)[:, None]
        lo = tl.minimum(tl.maximum(tl.math.div_rn(lo - m, s), 0.0), QMAX)
        hi = tl.minimum(tl.maximum(tl.math.div_rn(hi - m, s), 0.0), QMAX)
        packed = tl.floor(lo + 0.5).to(tl.int32) | (tl.floor(hi + 0.5).to(tl.int32) << 4)
        tl.store(data_row + offs // 2, packed.to(tl.uint8), mask=mask)
    else:
        mask = (g[:, None] < num_groups) & (j[None, :] < GROUP)
        offs = g[:, None] * GROUP + j[None, :]
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.minimum(tl.maximum(tl.math.div_rn(amax, QMAX), SCALE_LO), SCALE_HI).to(tl.float16)
        tl.store(scale_row + g, scale, mask=g < num_groups)
        x = tl.minimum(tl.maximum(tl.math.div_rn(x, scale.to(tl.float32)[:, None]), -QMAX), QMAX)
        if KV_FORMAT == _FP8:
            tl.store(data_row + offs, _float_to_fp8(x), mask=mask)
        else:
            tl.store(data_row + offs, tl.floor(x + 0.5).to(tl.int8), mask=mask)


@triton.jit
def _write_kv_quant_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_h, stride_kc_s, stride_vc_h, stride_vc_s,
    stride_ks_h, stride_ks_s, stride_vs_h, stride_vs_s,
    head_dim,
    K_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, K_BLOCK_G: tl.constexpr, K_BLOCK_J: tl.constexpr,
    K_QMAX: tl.constexpr,
    V_FORMAT: tl.constexpr, V_GROUP: tl.constexpr, V_BLOCK_G: tl.constexpr, V_BLOCK_J: tl.constexpr,
    V_QMAX: tl.constexpr,
    SCALE_LO: tl.constexpr, SCALE_HI: tl.constexpr,
):
    """K and V each in its own format (one of them may be a float cache, whose
    scale pointer is then never read)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slots mark padding tokens, as in _write_kv_kernel
        _quantize_store(
            k_ptr + t * stride_kt + h * stride_kh, k_cache_ptr + h * stride_kc_h + slot * stride_kc_s,
            k_scale_ptr + h * stride_ks_h + slot * stride_ks_s, head_dim,
            K_FORMAT, K_GROUP, K_BLOCK_G, K_BLOCK_J, K_QMAX, SCALE_LO, SCALE_HI,
        )
        _quantize_store(
            v_ptr + t * stride_vt + h * stride_vh, v_cache_ptr + h * stride_vc_h + slot * stride_vc_s,
            v_scale_ptr + h * stride_vs_h + slot * stride_vs_s, head_dim,
            V_FORMAT, V_GROUP, V_BLOCK_G, V_BLOCK_J, V_QMAX, SCALE_LO, SCALE_HI,
        )


def _kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels address it: fp8 as its uint8 bit patterns."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _scale_strides(scales: torch.Tensor | None) -> tuple[int, int, int]:
    """(head, page, slot) strides of a scales tensor (zeros for None: a float
    cache's, never read); its slots must be one run along (page, offset), like
    the cache's."""
    if scales is None:
        return 0, 0, 0
    if scales.stride(3) != 1 or scales.stride(1) != scales.shape[2] * scales.stride(2):
        raise ValueError("KV scales must be [heads, pages, page_size, groups] with contiguous pages")
    return scales.stride(0), scales.stride(1), scales.stride(2)


def _format_constexprs(fmt: KVFormat) -> tuple[int, int, int, int, float]:
    """(FORMAT, GROUP, BLOCK_G, BLOCK_J, QMAX) of _quantize_store for fmt."""
    if not fmt.quantized:
        return _FORMAT_IDS["auto"], fmt.head_dim, 1, _block(fmt.head_dim), 1.0
    group = fmt.group_size
    block_j = _block(group // 2 if fmt.name == "q4" else group)
    return _FORMAT_IDS[fmt.name], group, _block(fmt.groups), block_j, fmt.qmax


@triton.jit
def _load_kv(
    cache_base, scale_base, slot_offs, scale_offs, d, slot_mask, d_mask, num_groups,
    KV_FORMAT: tl.constexpr, GROUP: tl.constexpr,
):
    """A K or V tile: slot_offs / scale_offs / slot_mask (per slot) broadcast
    against d / d_mask (the head_dim index); fp32 values for a quantized cache,
    the cache's own dtype otherwise. num_groups: groups per vector (q4's
    minimums follow its scales)."""
    mask = slot_mask & d_mask
    if KV_FORMAT == _Q4:
        packed = tl.load(cache_base + slot_offs + d // 2, mask=mask, other=0).to(tl.int32)
        x = ((packed >> ((d % 2) * 4)) & 15).to(tl.float32)
    elif KV_FORMAT == _FP8:
        x = _fp8_to_float(tl.load(cache_base + slot_offs + d, mask=mask, other=0))
    else:
        x = tl.load(cache_base + slot_offs + d, mask=mask, other=0.0)
    if KV_FORMAT != _FLOAT:
        x = x.to(tl.float32) * tl.load(scale_base + scale_offs + d // GROUP, mask=mask, other=0.0).to(tl.float32)
    if KV_FORMAT == _Q4:
        x = x + tl.load(scale_base + scale_offs + num_groups + d // GROUP, mask=mask, other=0.0).to(tl.float32)
    return x


# --------------------------------------------------------------------------- paged attention


@triton.jit
def _find_sequence(cu_q_ptr, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence b whose query blocks hold `block_idx`: query blocks of b are
    numbered from cu_q[b] // BLOCK_Q + b (an upper bound on the blocks before it)."""
    lo = block_idx * 0  # int32 tensors from the start: loop-carried types must not change
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if start <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    page_table_ptr, cu_q_ptr, ctx_ptr,
    scale, num_seqs, num_query_heads, head_dim, sliding_window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kc_h, stride_kc_p, stride_kc_s, stride_vc_h, stride_vc_p, stride_vc_s,
    stride_pt, page_size,
    k_scale_ptr, v_scale_ptr, stride_ks_h, stride_ks_p, stride_ks_s, stride_vs_h, stride_vs_p, stride_vs_s,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    K_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_FORMAT: tl.constexpr, V_GROUP: tl.constexpr,
):
    """K_FORMAT / V_FORMAT: each cache's format (_FLOAT, _FP8, _Q8, _Q4);
    K_GROUP / V_GROUP: its values per scale. A float cache's scale pointer
    and strides are never read."""
    block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        seq = block_idx
        q_block = 0
    else:
        seq = _find_sequence(cu_q_ptr, block_idx, num_seqs, BLOCK_Q)
        q_block = block_idx - (tl.load(cu_q_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        ctx = tl.load(ctx_ptr + seq)
        first_pos = ctx - q_len  # position of query token 0

        rows = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        head = kv_head * GROUP + head_in_group
        row_valid = (tok < q_len) & (head_in_group < GROUP)
        q_pos = first_pos + tok
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim

        q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        qk_scale = scale * 1.4426950408889634  # exp2 domain

        # keys this block can see: [kv_lo, kv_hi)
        last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_hi = first_pos + last_tok + 1
        kv_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(first_pos + q_block * BLOCK_Q - sliding_window + 1, 0)
            kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
        num_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_begin = split * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kc_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kc_h
        vc_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vc_h
        ks_base = k_scale_ptr + kv_head.to(tl.int64) * stride_ks_h
        vs_base = v_scale_ptr + kv_head.to(tl.int64) * stride_vs_h
        pt_row = page_table_ptr + seq.to(tl.int64) * stride_pt
        for tile in range(tile_begin, tile_end):
            n = kv_lo + tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_valid = n < kv_hi
            page = tl.load(pt_row + n // page_size, mask=n_valid, other=0).to(tl.int64)
            in_page = (n % page_size).to(tl.int64)
            k_offs = page * stride_kc_p + in_page * stride_kc_s
            v_offs = page * stride_vc_p + in_page * stride_vc_s
            ks_offs = page * stride_ks_p + in_page * stride_ks_s
            vs_offs = page * stride_vs_p + in_page * stride_vs_s
            kt = _load_kv(kc_base, ks_base, k_offs[None, :], ks_offs[None, :], d[:, None], n_valid[None, :],
                          d_mask[:, None], head_dim // K_GROUP, K_FORMAT, K_GROUP)
            v = _load_kv(vc_base, vs_base, v_offs[:, None], vs_offs[:, None], d[None, :], n_valid[:, None],
                         d_mask[None, :], head_dim // V_GROUP, V_FORMAT, V_GROUP)
            kt = _cast(kt, q.dtype)
            v = _cast(v, q.dtype)
            s = _dot(q, kt, IEEE)
            if SOFTCAP:
                # Gemma 2: cap * tanh(scaled score / cap), then into the exp2 domain
                s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
            else:
                s = s * qk_scale
            visible = n_valid[None, :] & (n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (n[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = _dot(_cast(p, v.dtype), v, IEEE)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tok64 = (q_start + tok).to(tl.int64)
        store_mask = row_valid[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            o_offs = tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(out_ptr + o_offs, _cast(out, out_ptr.dtype.element_ty), mask=store_mask)
        else:
            # partials: [T, Hq, NUM_SPLITS, BLOCK_D] fp32 and log2-sum-exp [T, Hq, NUM_SPLITS]
            row_id = tok64 * num_query_heads + head
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(part_lse_ptr + row_id * NUM_SPLITS + split, lse, mask=row_valid)
            p_offs = (row_id * NUM_SPLITS + split)[:, None] * BLOCK_D + d[None, :]
            tl.store(part_out_ptr + p_offs, out, mask=store_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_query_heads, head_dim, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row_id = t * num_query_heads + h
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row_id * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    w = w / tl.sum(w, axis=0)
    d = tl.arange(0, BLOCK_D)
    parts = tl.load(
        part_out_ptr + (row_id * NUM_SPLITS + s)[:, None] * BLOCK_D + d[None, :],
        mask=s_mask[:, None] & (w[:, None] > 0.0), other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, _cast(out, out_ptr.dtype.element_ty), mask=d < head_dim)


def _num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice over; the split of each
    sequence's own context is computed in the kernel."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, triton.cdiv(2 * sms, batch * num_kv_heads)))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """The tiling is the caller's to choose only so that the tests can force splits and small
    blocks to reach every path."""
    k_fmt, v_fmt = paged_formats(k_cache, v_cache, k_scales, v_scales, q.shape[-1])
    q = rotate(q, k_fmt)  # rotated keys (fp8): Hq.Hk = q.k; rotated values: the output is rotated back below
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    batch = context_lens.shape[0]
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("KV cache head_dim must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = num_heads // num_kv_heads
    group_pad = _block(group)
    decode_only = tokens == batch  # every sequence has >= 1 query token, so this means q_len == 1 for all
    if block_m is None:
        block_m = 16 if (decode_only or _INTERPRET or q.device.type != "cuda") else 64
    block_m = max(block_m, group_pad, 16)  # tl.dot needs M >= 16
    block_q = 1 if decode_only else block_m // group_pad
    block_n = block_n or (16 if _INTERPRET or q.device.type != "cuda" else 64)
    block_d = _block(head_dim)
    if num_splits is None:
        num_splits = _num_splits(batch, num_kv_heads, q.device) if decode_only else 1
    num_blocks = batch if decode_only else tokens // block_q + batch
    if num_splits > 1:
        part_out = torch.empty(tokens, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    args = [
        q, _kernel_view(k_cache), _kernel_view(v_cache), out, part_out, part_lse,
        page_table, cu_seqlens_q, context_lens,
        float(scale), batch, num_heads, head_dim, int(sliding_window or 0), float(softcap or 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), k_cache.shape[2],
    ]
    consts = dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, NUM_SPLITS=num_splits, DECODE_ONLY=decode_only,
        HAS_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32,
    )
    grid = (num_blocks, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        *args, k_scales if k_fmt.quantized else k_cache, v_scales if v_fmt.quantized else v_cache,
        *_scale_strides(k_scales if k_fmt.quantized else None),
        *_scale_strides(v_scales if v_fmt.quantized else None),
        **consts, K_FORMAT=_FORMAT_IDS[k_fmt.name], K_GROUP=k_fmt.group_size,
        V_FORMAT=_FORMAT_IDS[v_fmt.name], V_GROUP=v_fmt.group_size,
    )
    if num_splits > 1:
        _merge_splits_kernel[(tokens, num_heads)](
            part_out, part_lse, out, num_heads, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=_block(num_splits), BLOCK_D=block_d,
        )
    return rotate(out, v_fmt)
