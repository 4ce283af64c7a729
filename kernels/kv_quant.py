"""Quantized paged KV cache formats: what each stores, and the torch quantize /
dequantize that define them (the reference path and the tests use these; the
Triton kernels reproduce them bit for bit).

A KV cache is what bounds concurrency on a GPU: at 8 or 4 bits per value a
cache holds two to four times the tokens of a 16-bit one. Each (head, token)
vector is quantized on its own when written, so a write touches only its slot
(pages shared by prefix dedup are never rewritten), and paged attention
dequantizes only the pages it reads.

The format is decided by the cache tensor's dtype; the cache keeps the layout
[num_kv_heads, num_pages, page_size, X] and a quantized one has a float16
scales tensor [num_kv_heads, num_pages, page_size, groups] beside it:

- floating ("auto"): the model's dtype, X = head_dim, no scales.
- torch.float8_e4m3fn ("fp8"): X = head_dim, one scale per vector
  (amax / 448), so the 3-bit mantissa's relative error (2^-4) applies to
  every vector whatever its magnitude.
- torch.int8 ("q8"): symmetric int8, X = head_dim, one scale per group of
  32 values along head_dim (amax / 127).
- torch.uint8 ("q4"): symmetric 4-bit in [-7, 7] stored as value + 8, two per
  byte (element 2j in the low nibble of byte j, 2j + 1 in the high one),
  X = head_dim / 2, one scale per group of 32 (amax / 7).

q4 also rotates each group of K and V by a normalized Hadamard transform
before quantizing (as exllamav2's Q4 cache does). Real keys have a few
outlier channels; in a group holding one, the scale is set by the outlier and
the other 31 values quantize to almost nothing. The rotation spreads the
outlier over the whole group, so the group's max is close to its RMS. It is
orthonormal and symmetric (its own inverse): attention rotates q instead of
dequantized keys (q.k = Hq.Hk) and rotates its output back (V's rotation
passes through the softmax-weighted sum), so callers never see it.

Measured (tests/test_kv_quant_kernels.py's realistic data: K with 4 of 128
channels at 8-15x the others on a per-channel offset, Laplace V, unit q;
head_dim 128, decode, verify and prefill rows, no window or soft-cap; mean
over 10 seeds), the mean
relative error of the attention output against a full-precision cache is:
fp8 0.039, q8 0.019, q4 0.158 with the rotation and 0.311 without it.
Rotating V as well as K helps less but measurably (dense attention over 300
tokens: K rotated only 0.207, K and V 0.194), so both are rotated. q8 and
fp8 are not: fp8's error is relative to each value, not to a group max, so
outliers do not hurt it, and q8 is already within 2%.

Scales are clamped to [2^-14, 65504] (float16's normal range): a zero vector
gets the smallest scale and quantizes to zeros, never 0/0 (vectors whose
amax / qmax is below 2^-14 are stored with that scale: an absolute error of
at most 2^-15). Rounding is half up for q8/q4 (floor(x + 0.5)), which the
kernels compute exactly the same way; fp8 rounds to nearest even, as torch's
conversion does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "q8", "q4")

#: Values per scale for q8 / q4 (the whole head vector when head_dim is smaller).
GROUP_SIZE = 32
FP8_MAX = 448.0
Q8_MAX = 127.0
Q4_MAX = 7.0
SCALE_MIN = 2.0**-14
SCALE_MAX = 65504.0
SCALE_DTYPE = torch.float16

_DATA_DTYPES = {"fp8": torch.float8_e4m3fn, "q8": torch.int8, "q4": torch.uint8}
_NAMES = {dtype: name for name, dtype in _DATA_DTYPES.items()}
_QMAX = {"fp8": FP8_MAX, "q8": Q8_MAX, "q4": Q4_MAX}


@dataclass(frozen=True)
class KVFormat:
    """How one cache stores a (head, token) vector of head_dim values.

    data_dtype / data_dim: the cache tensor's dtype and last dim (X);
    scale_groups: the scales tensor's last dim (0: no scales)."""

    name: str
    data_dtype: torch.dtype
    head_dim: int
    data_dim: int
    scale_groups: int

    @property
    def quantized(self) -> bool:
        return self.scale_groups > 0

    @property
    def group_size(self) -> int:
        """Values sharing one scale."""
        return self.head_dim // self.scale_groups if self.scale_groups else self.head_dim

    @property
    def rotated(self) -> bool:
        """Whether K/V are stored Hadamard-rotated within each group (q4)."""
        return self.name == "q4"

    @property
    def qmax(self) -> float:
        """The largest stored magnitude: a group's amax maps to it."""
        return _QMAX[self.name]

    @property
    def bytes_per_head_vector(self) -> int:
        """Bytes one (head, token) K or V vector takes, scales included."""
        return self.data_dim * self.data_dtype.itemsize + self.scale_groups * SCALE_DTYPE.itemsize


def kv_cache_format(cache_dtype: str, head_dim: int, model_dtype: torch.dtype) -> KVFormat:
    """The storage of cache_dtype (one of KV_CACHE_DTYPES) for heads of head_dim
    values; "auto" stores model_dtype. ValueError for an unknown name or a
    head_dim the format cannot split into its groups."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {cache_dtype!r}")
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if cache_dtype == "auto":
        if model_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"cache_dtype 'auto' stores the model's dtype, which must be float32, float16 or bfloat16, "
                f"not {model_dtype}"
            )
        return KVFormat("auto", model_dtype, head_dim, head_dim, 0)
    if cache_dtype == "fp8":
        return KVFormat("fp8", torch.float8_e4m3fn, head_dim, head_dim, 1)
    group = min(GROUP_SIZE, head_dim)
    if head_dim % group:
        raise ValueError(
            f"cache_dtype {cache_dtype!r} needs head_dim to be a multiple of {GROUP_SIZE} (or at most "
            f"{GROUP_SIZE}), got {head_dim}; use 'fp8' or 'auto'"
        )
    if cache_dtype == "q8":
        return KVFormat("q8", torch.int8, head_dim, head_dim, head_dim // group)
    if group & (group - 1) or group < 2:
        raise ValueError(
            f"cache_dtype 'q4' needs head_dim to be a multiple of {GROUP_SIZE} or a power of two (its "
            f"Hadamard rotation works on power-of-two groups), got {head_dim}; use 'q8', 'fp8' or 'auto'"
        )
    return KVFormat("q4", torch.uint8, head_dim, head_dim // 2, head_dim // group)


def format_of(cache: torch.Tensor, scales: torch.Tensor | None, what: str = "cache") -> KVFormat:
    """The format of a cache tensor [Hkv, pages, page_size, X] (by its dtype)
    and its scales, checked: a quantized cache needs float16 scales shaped
    [Hkv, pages, page_size, groups]."""
    name = _NAMES.get(cache.dtype)
    if name is None:
        if not cache.dtype.is_floating_point:
            raise ValueError(
                f"{what} dtype {cache.dtype} is no KV cache format: floating, torch.float8_e4m3fn (fp8), "
                "torch.int8 (q8) or torch.uint8 (q4)"
            )
        return KVFormat("auto", cache.dtype, cache.shape[-1], cache.shape[-1], 0)
    if scales is None:
        raise ValueError(f"{what} is quantized ({name}, {cache.dtype}) but no scales were given")
    if scales.dtype != SCALE_DTYPE or scales.dim() != cache.dim() or scales.shape[:-1] != cache.shape[:-1]:
        raise ValueError(
            f"{what} scales must be float16 shaped {tuple(cache.shape[:-1])} + (groups,); got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )
    head_dim = cache.shape[-1] * (2 if name == "q4" else 1)
    fmt = kv_cache_format(name, head_dim, torch.float32)
    if scales.shape[-1] != fmt.scale_groups:
        raise ValueError(f"{what} scales for {name} with head_dim {head_dim} need {fmt.scale_groups} groups, "
                         f"got {scales.shape[-1]}")
    return fmt


def paged_format(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    head_dim: int,
) -> KVFormat:
    """The one format a layer's K and V caches share, checked against their
    scales and the head_dim of the K/V or q given with them."""
    fmt = format_of(k_cache, k_scales, "k_cache")
    if format_of(v_cache, v_scales, "v_cache") != fmt:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share one format")
    if fmt.head_dim != head_dim:
        raise ValueError(f"the {fmt.name} cache holds head_dim {fmt.head_dim} (last dim {fmt.data_dim}), "
                         f"not the {head_dim} of the tensors given")
    return fmt


def rotate(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x [..., head_dim] with each group multiplied by the normalized Sylvester
    Hadamard matrix (symmetric and orthonormal: its own inverse), computed in
    fp32 and returned in x's dtype; x itself when fmt is not rotated.

    A fast Walsh-Hadamard transform of elementwise ops, not a matmul, so every
    row's result is the same bits whatever the batch shape (the reference and
    the Triton path rotate differently shaped tensors and must agree exactly)."""
    if not fmt.rotated:
        return x
    g = fmt.group_size
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < g:
        pairs = y.reshape(*lead, -1, 2, h)
        y = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), dim=-2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / math.sqrt(g))).to(x.dtype)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (data [..., data_dim] of fmt.data_dtype, scales
    [..., scale_groups] float16); each vector on its own."""
    x = rotate(x.float(), fmt)
    groups = x.reshape(*x.shape[:-1], fmt.scale_groups, fmt.group_size)
    scales = (groups.abs().amax(-1) / fmt.qmax).clamp(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    y = (groups / scales.float().unsqueeze(-1)).clamp(-fmt.qmax, fmt.qmax).reshape(x.shape)
    if fmt.name == "fp8":
        return y.to(torch.float8_e4m3fn), scales
    q = torch.floor(y + 0.5)
    if fmt.name == "q8":
        return q.to(torch.int8), scales
    nibbles = (q + 8).to(torch.uint8).reshape(*x.shape[:-1], fmt.data_dim, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4), scales


def dequantize_into(out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Write data * scales into out ([..., head_dim] fp32) and return it: the
    values as stored (still rotated for q4). Only fp32 arithmetic, so the
    Triton kernels, which dequantize in fp32 too, match it exactly."""
    if fmt.name == "q4":
        pairs = out.view(*out.shape[:-1], fmt.data_dim, 2)
        pairs[..., 0].copy_(data & 15)
        pairs[..., 1].copy_(data >> 4)
        out.sub_(8)
    else:
        out.copy_(data)
    groups = out.view(*out.shape[:-1], fmt.scale_groups, fmt.group_size)
    groups.mul_(scales.unsqueeze(-1).float())
    return out


def dequantize(data: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """data [..., data_dim] and scales -> the values [..., head_dim] in fp32
    (rotated back for q4): what attention over this cache sees."""
    out = torch.empty(*data.shape[:-1], fmt.head_dim, dtype=torch.float32, device=data.device)
    return rotate(dequantize_into(out, data, scales, fmt), fmt)
