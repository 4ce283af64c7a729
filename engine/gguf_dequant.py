"""Dequantize GGUF tensor bytes with torch, one tensor at a time.

GGUF stores most weights in ggml's block formats: a run of values shares one
or two fp16 scales (and, for the K-quants, 6-bit sub-block scales packed into
12 bytes). The engine computes in float, so each tensor is expanded once at
load; the vectorized torch code below works on every block of a tensor at once
and is written from the block layouts in ggml's `ggml-common.h`.

Output element order follows ggml's reference dequantizers; the formulas are
checked against the `gguf` package's numpy dequantizer in tests/test_gguf_loading.py.

When the engine keeps weights quantized (engine/quantized_linear.py),
`to_quantized` maps the blocks that fit its formats straight onto them,
without the float expansion: Q4_0, Q4_1 and Q4_K onto int4 with group 32
(every 32-value run of these has one scale and one offset: Q4_0's
(q - 8) * d is q * d - 8d, Q4_1's q * d + m, and each Q4_K sub-block's
q * (d * sc) - dmin * m), Q8_0 onto int8 with group 32. The fp32 scales and
offsets are the products the dequantizers above compute, so
QuantizedWeight.dequantize() returns the same floats bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.quantized_linear import QuantizedWeight, pack_int4

# ggml type -> (values per block, bytes per block), for the types this module expands.
BLOCK_SIZES: dict[Q, tuple[int, int]] = {
    q: GGML_QUANT_SIZES[q]
    for q in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
}
FLOAT_TYPES: dict[Q, torch.dtype] = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED_TYPES = (*FLOAT_TYPES, *BLOCK_SIZES)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as a float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(blocks, n) bytes -> (blocks, 2n): all low nibbles, then all high nibbles (ggml's order)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(blocks, bytes) little-endian bit field -> (blocks, count) of 0/1, bit i of the field at column i."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :count]


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return (_nibbles(b[:, 2:18]).float() - 8) * d


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return _nibbles(b[:, 4:20]).float() * d + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    high = _bits(b[:, 2:6], 32) << 4
    return ((_nibbles(b[:, 6:22]) | high).float() - 16) * d


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    high = _bits(b[:, 4:8], 32) << 4
    return (_nibbles(b[:, 8:24]) | high).float() * d + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _crumbs(packed: torch.Tensor) -> torch.Tensor:
    """2-bit fields of a K-quant half block: (blocks, 32) bytes -> (blocks, 128), shift 0, 2, 4, 6 in turn."""
    return torch.cat([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    q = torch.cat([_crumbs(qs[:, :32]), _crumbs(qs[:, 32:])], dim=1).float()
    scale = ((scales & 0x0F).float() * d).repeat_interleave(16, dim=1)
    offset = ((scales >> 4).float() * dmin).repeat_interleave(16, dim=1)
    return q * scale - offset


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0..7, high 2 bits from bytes 8..11."""
    low = torch.cat([packed[:, :8] & 0x0F, packed[:, :8] >> 4], dim=1)
    high = torch.cat([(packed[:, 8:12] >> s) & 3 for s in (0, 2, 4, 6)], dim=1)
    return (low | (high << 4)).float() - 32


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b, 108)
    q = torch.cat([_crumbs(qs[:, :32]), _crumbs(qs[:, 32:])], dim=1).float()
    # A clear high bit subtracts 4; output j of each 32-run reads bit (j // 32) of hmask[j % 32].
    high = _bits(hmask, 256).reshape(-1, 32, 8).transpose(1, 2).reshape(-1, 256)
    q = q - 4 * (1 - high.float())
    return q * (_q3_k_scales(scales) * d).repeat_interleave(16, dim=1)


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K, packed in 12 bytes."""
    first, second, third = packed[:, :4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([first & 63, (third & 0x0F) | ((first >> 6) << 4)], dim=1)
    mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k4_values(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 256 nibbles: each 32-byte run gives its low nibbles, then its high nibbles."""
    runs = qs.reshape(-1, 4, 32)
    return torch.stack([runs & 0x0F, runs >> 4], dim=2).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k4_scales(b[:, 4:16])
    q = _k4_values(b[:, 16:144]).float()
    return q * (scales * d).repeat_interleave(32, dim=1) - (mins * dmin).repeat_interleave(32, dim=1)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k4_scales(b[:, 4:16])
    # Output j reads bit (j // 32) of qh[j % 32] as its fifth bit.
    high = _bits(b[:, 16:48], 256).reshape(-1, 32, 8).transpose(1, 2).reshape(-1, 256)
    q = (_k4_values(b[:, 48:176]) | (high << 4)).float()
    return q * (scales * d).repeat_interleave(32, dim=1) - (mins * dmin).repeat_interleave(32, dim=1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b, 208)
    # Per 128-value half: four 32-runs; run k takes nibble (k // 2) of ql[32 * (k % 2) + l] and bits 2k..2k+1 of qh[l].
    low = torch.cat([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=2)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)
    q = (low | (high << 4)).reshape(-1, 256).float() - 32
    return q * (scales * d).repeat_interleave(16, dim=1)


_DEQUANTIZERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}


def dequantize(raw: np.ndarray, ggml_type: Q, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` (torch order: rows first) that `raw`, the file's bytes of
    one tensor (any numpy view), holds in `ggml_type`, as `dtype`."""
    if ggml_type in FLOAT_TYPES:
        values = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy())
        return values.view(FLOAT_TYPES[ggml_type]).reshape(shape).to(dtype)
    block_bytes = BLOCK_SIZES[ggml_type][1]
    blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).copy()).reshape(-1, block_bytes)
    values = _DEQUANTIZERS[ggml_type](blocks)
    return values.reshape(shape).to(dtype)


def _int4_fields(ggml_type: Q, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [blocks, values] uint8 0..15, scale and offset [blocks, runs of 32]) with value = q * scale + offset."""
    if ggml_type == Q.Q4_0:
        d = _f16(b, 0)
        return _nibbles(b[:, 2:18]), d, -8 * d
    if ggml_type == Q.Q4_1:
        return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k4_scales(b[:, 4:16])
    return _k4_values(b[:, 16:144]), scales * d, -(mins * dmin)


INT4_EXACT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
INT8_EXACT_TYPES = (Q.Q8_0,)


def to_quantized(raw: np.ndarray, ggml_type: Q, shape: tuple[int, int], quantize: str) -> QuantizedWeight | None:
    """The [rows, cols] matrix `raw` holds as a QuantizedWeight of format `quantize`
    ("int4" or "int8") with group 32, built from the blocks without expanding
    them; None when ggml_type has no exact mapping onto that format."""
    exact = INT4_EXACT_TYPES if quantize == "int4" else INT8_EXACT_TYPES
    if ggml_type not in exact:
        return None
    rows, cols = shape
    block_bytes = BLOCK_SIZES[ggml_type][1]
    blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).copy()).reshape(-1, block_bytes)
    groups = cols // 32
    if ggml_type == Q.Q8_0:
        q = blocks[:, 2:34].contiguous().view(torch.int8).reshape(rows, cols)
        return QuantizedWeight(q, _f16(blocks, 0).reshape(rows, groups), None, 8, 32)
    q, scales, offsets = _int4_fields(ggml_type, blocks)
    return QuantizedWeight(
        pack_int4(q.reshape(rows, cols)), scales.reshape(rows, groups), offsets.reshape(rows, groups), 4, 32
    )
