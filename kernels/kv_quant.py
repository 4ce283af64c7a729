"""Quantized paged KV cache formats: what each stores, and the torch quantize /
dequantize that define them (the reference path and the tests use these; the
Triton kernels reproduce them bit for bit).

A KV cache is what bounds concurrency on a GPU: at 8 or 4 bits per value a
cache holds two to four times the tokens of a 16-bit one. Each (head, token)
vector is quantized on its own when written, so a write touches only its slot
(pages shared by prefix dedup are never rewritten), and paged attention
dequantizes only the pages it reads.

Each cache's format is decided by its tensor's dtype, K's and V's separately
(kv_cache_format maps a cache dtype name to the pair); a cache keeps the
layout [num_kv_heads, num_pages, page_size, X] and a quantized one has a
float16 scales tensor [num_kv_heads, num_pages, page_size, groups] beside it:

- floating ("auto"): the model's dtype, X = head_dim, no scales.
- torch.float8_e4m3fn ("fp8"): X = head_dim, one scale per group of 32
  values along head_dim (amax / 448), groups Hadamard-rotated (below).
- torch.int8 ("q8"): symmetric int8, X = head_dim, one scale per group of
  32 values along head_dim (amax / 127), not rotated.
- torch.uint8 ("q4"): asymmetric 4-bit, levels 0..15, two per byte (element
  2j in the low nibble of byte j, 2j + 1 in the high one), X = head_dim / 2;
  per group of 16 values a scale (max - min) / 15 and the minimum, so the
  scales tensor's last dim is 2 * groups (the scales, then the minimums) and
  a value is level * scale + min. Not rotated. 6 bits per value with its
  scales (head_dim 64: 48 bytes a vector, against 36 for the symmetric
  groups of 32 it replaced, 72 for q8).
- "k8v4": K as q8, V as q4 (a cache dtype name only: the K cache is int8,
  the V cache uint8). Keys are what 4 bits break, values take them well.

A head_dim under a group is one group. fp8 rotates each group of K and V by
a normalized Hadamard transform before quantizing (as exllamav2's Q4 cache
does), so it needs power-of-two groups: head_dim a multiple of 32 or a power
of two; q8 needs a multiple of 32 (or at most 32), q4 a multiple of 16 (or
an even number under 16); "auto" takes any. Real keys have a few outlier
channels, whose own relative error dominates q.k with nothing to average it
out (fp8). The rotation spreads an outlier over the whole group, so the
group's max is close to its RMS and every value's error is a similar small
share of it. It is orthonormal and symmetric (its own inverse): attention
rotates q when K is rotated (q.k = Hq.Hk) and rotates its output back when V
is (V's rotation passes through the softmax-weighted sum), so callers never
see it. q4 instead keeps an outlier in a group of 16 with its own minimum:
real keys carry per-channel offsets, so a group's values are skewed, and
the minimum puts all 16 levels where the values are.

Measured on a real model (SmolLM2-135M, head_dim 64, 768 tokens of
bench/data/prose.txt through genq_dev.perplexity; full-precision cache:
perplexity 20.146), as perplexity / mean KL divergence of the next-token
distribution from the full-precision cache's:

    fp8   20.156 / 0.0154   (per-vector scale, unrotated: 20.597 / 0.0219;
                             groups of 32, unrotated: 20.748 / 0.0194)
    q8    20.231 / 0.0015
    q4    22.260 / 0.1276
    k8v4  20.266            (fp8 keys instead: 20.190 / 0.047)

q4 replaced symmetric [-7, 7] levels with one scale per Hadamard-rotated
group of 32 (24.360 / 0.2174 here; K only at that q4: 21.315 / 0.1664, V
only: 20.681 / 0.0388; k8v4 with it: 20.709 / 0.0365). Other 4-bit variants
tried, K and V alike unless noted (the rest of the cache as named), each
vector on its own (issue 13's search; a rounding flip in one value changes
this perplexity by several percent, so the KL decided):

    rotation across the whole head_dim, symmetric, groups of 32   21.326 / 0.2145
    the same, random signs before the rotation                    21.743 / 0.2416
    rotated groups of 32, symmetric, per-group best of 7 clip
        ratios (0.7-1.0 of amax, least squared error)             21.905 / 0.1830
    whole-head rotation, NF4 code book (amax-scaled)              20.605 / 0.2429
    the same, per-group best of 6 clip ratios                     21.751 / 0.1855
    whole-head rotation, [-8, 7] (q4_0's sign trick)              22.495 / 0.2005
    whole-head rotation, symmetric, groups of 16                  22.484 / 0.2074
    K only (V the old q4): unrotated min/max groups of 32         21.977 / 0.2131
                           rotated groups of 32, min/max          21.729 / 0.1653
                           unrotated min/max groups of 16         21.977 / 0.1383
                           whole-head rotation, min/max, 16       21.149 / 0.1397
                           the same, best of 5 clip ratios        20.155 / 0.1260

Min/max with a zero point is what moved the KL; clip searches gain less
and would have to be reproduced bit for bit by the write kernel. Perplexity
on one text moves by several percent for reasons unrelated to the error at
4 bits (and +-0.5% at 8; some quantized caches score below the
full-precision one); the KL divergence is the steadier figure. On
tests/test_kv_quant_kernels.py's synthetic data (K with 4 of 128 channels at
8-15x the others on a per-channel offset, Laplace V, unit q; head_dim 128,
decode, verify and prefill rows, no window or soft-cap; mean over 10 seeds)
the mean relative error of the attention output against a full-precision
cache is fp8 0.047, q8 0.018, q4 0.145 (the old symmetric q4: 0.158, 0.311
unrotated), k8v4 0.075; there fp8's rotation costs (0.031 unrotated), which
the real model's keys contradict, so the real model decided.

Scales are clamped to [2^-14, 65504] (float16's normal range): a zero vector
gets the smallest scale and quantizes to zeros, never 0/0 (vectors whose
amax / qmax, or for q4 (max - min) / 15, is below 2^-14 are stored with that
scale: an absolute error of at most 2^-15); q4's minimums are clamped to
+-65504 and rounded to float16, and levels to 0..15. Rounding is half up for
q8/q4 (floor(x + 0.5)), which the kernels compute exactly the same way; fp8
rounds to nearest even, as torch's conversion does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "q8", "q4", "k8v4")

#: cache_dtype -> (K format, V format), for the names whose K and V are stored differently
_SPLIT_DTYPES = {"k8v4": ("q8", "q4")}

#: Values per scale (the whole head vector when head_dim is smaller).
GROUP_SIZE = 32
FP8_MAX = 448.0
Q8_MAX = 127.0
Q4_MAX = 15.0
#: Values per scale and minimum in q4.
Q4_GROUP_SIZE = 16
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
    scale_groups: the scales tensor's last dim (0: no scales): one scale per
    group of group_size values, and for q4 one minimum per group after them."""

    name: str
    data_dtype: torch.dtype
    head_dim: int
    data_dim: int
    scale_groups: int
    group_size: int

    @property
    def quantized(self) -> bool:
        return self.scale_groups > 0

    @property
    def groups(self) -> int:
        """Groups of group_size values per vector (each with its own scale)."""
        return self.head_dim // self.group_size

    @property
    def asymmetric(self) -> bool:
        """Whether each group stores a minimum (zero point) beside its scale (q4)."""
        return self.name == "q4"

    @property
    def rotated(self) -> bool:
        """Whether vectors are stored Hadamard-rotated within each group (fp8)."""
        return self.name == "fp8"

    @property
    def qmax(self) -> float:
        """The largest stored magnitude: a group's amax maps to it (q4: the
        largest level, its max - min maps to it)."""
        return _QMAX[self.name]

    @property
    def bytes_per_head_vector(self) -> int:
        """Bytes one (head, token) K or V vector takes, scales included."""
        return self.data_dim * self.data_dtype.itemsize + self.scale_groups * SCALE_DTYPE.itemsize


@dataclass(frozen=True)
class KVCacheFormat:
    """A cache dtype's storage: K and V each have their own KVFormat (the same
    one except for split formats such as "k8v4")."""

    name: str
    k: KVFormat
    v: KVFormat

    @property
    def bytes_per_head_token(self) -> int:
        """Bytes one token takes in one KV head, K and V together, scales included."""
        return self.k.bytes_per_head_vector + self.v.bytes_per_head_vector


def kv_cache_format(cache_dtype: str, head_dim: int, model_dtype: torch.dtype) -> KVCacheFormat:
    """The storage of cache_dtype (one of KV_CACHE_DTYPES) for heads of head_dim
    values; "auto" stores model_dtype. ValueError for an unknown name or a
    head_dim the format cannot split into its groups."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {cache_dtype!r}")
    k_name, v_name = _SPLIT_DTYPES.get(cache_dtype, (cache_dtype, cache_dtype))
    k = vector_format(k_name, head_dim, model_dtype, cache_dtype)
    v = k if v_name == k_name else vector_format(v_name, head_dim, model_dtype, cache_dtype)
    return KVCacheFormat(cache_dtype, k, v)


def vector_format(name: str, head_dim: int, model_dtype: torch.dtype, cache_dtype: str | None = None) -> KVFormat:
    """The KVFormat of one of "auto", "fp8", "q8", "q4" (part of cache_dtype,
    which error messages name) for heads of head_dim values."""
    cache_dtype = cache_dtype or name
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if name == "auto":
        if model_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"cache_dtype 'auto' stores the model's dtype, which must be float32, float16 or bfloat16, "
                f"not {model_dtype}"
            )
        return KVFormat("auto", model_dtype, head_dim, head_dim, 0, head_dim)
    if name == "q4":
        group = min(Q4_GROUP_SIZE, head_dim)
        if head_dim % group or head_dim % 2:
            raise ValueError(
                f"cache_dtype {cache_dtype!r} needs head_dim to be a multiple of {Q4_GROUP_SIZE} (or an even "
                f"number below it), got {head_dim}; use 'auto'" + (" or 'q8'" if head_dim <= GROUP_SIZE else "")
            )
        return KVFormat("q4", torch.uint8, head_dim, head_dim // 2, 2 * (head_dim // group), group)
    group = min(GROUP_SIZE, head_dim)
    if name == "q8":
        if head_dim % group:
            raise ValueError(
                f"cache_dtype {cache_dtype!r} needs head_dim to be a multiple of {GROUP_SIZE} (or at most "
                f"{GROUP_SIZE}), got {head_dim}; use 'auto'"
            )
        return KVFormat("q8", torch.int8, head_dim, head_dim, head_dim // group, group)
    if head_dim % group or group & (group - 1) or group < 2:
        raise ValueError(
            f"cache_dtype {cache_dtype!r} needs head_dim to be a multiple of {GROUP_SIZE} or a power of two (its "
            f"Hadamard rotation works on power-of-two groups), got {head_dim}; use 'auto'"
            + (" or 'q8'" if head_dim <= GROUP_SIZE else "")
        )
    return KVFormat("fp8", torch.float8_e4m3fn, head_dim, head_dim, head_dim // group, group)


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
        return KVFormat("auto", cache.dtype, cache.shape[-1], cache.shape[-1], 0, cache.shape[-1])
    if scales is None:
        raise ValueError(f"{what} is quantized ({name}, {cache.dtype}) but no scales were given")
    if scales.dtype != SCALE_DTYPE or scales.dim() != cache.dim() or scales.shape[:-1] != cache.shape[:-1]:
        raise ValueError(
            f"{what} scales must be float16 shaped {tuple(cache.shape[:-1])} + (groups,); got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )
    head_dim = cache.shape[-1] * (2 if name == "q4" else 1)
    fmt = vector_format(name, head_dim, torch.float32)
    if scales.shape[-1] != fmt.scale_groups:
        raise ValueError(f"{what} scales for {name} with head_dim {head_dim} need {fmt.scale_groups} groups, "
                         f"got {scales.shape[-1]}")
    return fmt


def paged_formats(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    head_dim: int,
) -> tuple[KVFormat, KVFormat]:
    """The formats of a layer's K and V caches (each by its own dtype; they may
    differ, as in "k8v4"), checked against their scales and the head_dim of the
    K/V or q given with them."""
    formats = (format_of(k_cache, k_scales, "k_cache"), format_of(v_cache, v_scales, "v_cache"))
    for what, fmt in zip(("k_cache", "v_cache"), formats):
        if fmt.head_dim != head_dim:
            raise ValueError(f"the {fmt.name} {what} holds head_dim {fmt.head_dim} (last dim {fmt.data_dim}), "
                             f"not the {head_dim} of the tensors given")
    return formats


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
    if fmt.asymmetric:
        return _quantize_q4(x.float(), fmt)
    x = rotate(x.float(), fmt)
    groups = x.reshape(*x.shape[:-1], fmt.groups, fmt.group_size)
    scales = (groups.abs().amax(-1) / fmt.qmax).clamp(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    y = (groups / scales.float().unsqueeze(-1)).clamp(-fmt.qmax, fmt.qmax).reshape(x.shape)
    if fmt.name == "fp8":
        return y.to(torch.float8_e4m3fn), scales
    return torch.floor(y + 0.5).to(torch.int8), scales


def _quantize_q4(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """q4: per group of 16, minimum m (float16, clamped to float16's range) and
    scale s = (max - min) / 15 (clamped like every scale); the value
    round((x - m) / s), in 0..15, two per byte."""
    groups = x.reshape(*x.shape[:-1], fmt.groups, fmt.group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    mins = low.clamp(-SCALE_MAX, SCALE_MAX).to(SCALE_DTYPE)
    scales = ((high - low) / fmt.qmax).clamp(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    y = (groups - mins.float().unsqueeze(-1)) / scales.float().unsqueeze(-1)
    q = torch.floor(y.clamp(0.0, fmt.qmax) + 0.5).to(torch.uint8).reshape(*x.shape[:-1], fmt.data_dim, 2)
    return q[..., 0] | (q[..., 1] << 4), torch.cat((scales, mins), dim=-1)


def dequantize_into(out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Write the values data stands for into out ([..., head_dim] fp32) and
    return it: data * scale (+ min for q4), still rotated for fp8. Only fp32
    arithmetic, so the Triton kernels, which dequantize in fp32 too, match it."""
    if fmt.name == "q4":
        pairs = out.view(*out.shape[:-1], fmt.data_dim, 2)
        pairs[..., 0].copy_(data & 15)
        pairs[..., 1].copy_(data >> 4)
    else:
        out.copy_(data)
    groups = out.view(*out.shape[:-1], fmt.groups, fmt.group_size)
    groups.mul_(scales[..., : fmt.groups].unsqueeze(-1).float())
    if fmt.asymmetric:
        groups.add_(scales[..., fmt.groups :].unsqueeze(-1).float())
    return out


def dequantize(data: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """data [..., data_dim] and scales -> the values [..., head_dim] in fp32
    (rotated back for fp8): what attention over this cache sees."""
    out = torch.empty(*data.shape[:-1], fmt.head_dim, dtype=torch.float32, device=data.device)
    return rotate(dequantize_into(out, data, scales, fmt), fmt)
