"""Weight-only quantized matmul: y = x @ W^T (+ bias) where W is stored as
8- or 4-bit integers with per-group float scales (and, for 4 bits, offsets).

Format (the one every path here reads; engine/quantized_linear.py makes it):

- qweight: int8 [N, K] (8 bits), or uint8 [N, K / 2] (4 bits: column 2j in
  the low nibble of byte j, column 2j + 1 in the high nibble, values 0..15);
- scales: float32 [N, K / group_size], offsets: float32 [N, K / group_size]
  or None; W[n, k] = q[n, k] * scales[n, g] + offsets[n, g] with g = k // group_size.

The "q * scale + offset" form (offset = the group's minimum) is the one
llama.cpp's Q4_1 and Q4_K blocks use, so those map onto it bit for bit; fp32
scales keep Q4_K's products of an fp16 scale and a 6-bit sub-scale exact.

quant_matmul is the torch operator genq::quant_matmul (like every kernel,
kernels/ops.py: a fake function gives its output from metadata, for
FakeTensorMode, torch.compile and CUDA graphs), its implementation picked by
the same rule as the other kernels (kernels/dispatch.py): the Triton kernel
(kernels/triton_quant_matmul.py) for CUDA tensors or when GENQ_FORCE_TRITON=1
(Triton's interpreter on CPU tensors); otherwise the torch reference below,
which dequantizes the whole matrix to x's dtype and calls F.linear. The
reference is also the oracle the Triton kernel and the engine's CPU fast
paths are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import dispatched, entry_point, register


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> uint8 [N, K] of values 0..15 (even columns from the low nibbles)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 (K even) -> uint8 [N, K / 2], the inverse of unpack_int4."""
    values = values.to(torch.uint8)
    return values[:, 0::2] | (values[:, 1::2] << 4)


def dequantize_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W [N, K] in dtype, computed in fp32 (q * scale + offset) and rounded once.
    One fp32 buffer, written in place (on CPU this runs per call: it is the fp32 path)."""
    rows = qweight.shape[0]
    if bits == 4:
        values = torch.empty(rows, qweight.shape[1], 2, dtype=torch.float32, device=qweight.device)
        values[..., 0] = qweight & 0x0F
        values[..., 1] = qweight >> 4
    else:
        values = qweight.float()
    cols = values.numel() // rows
    grouped = values.view(rows, cols // group_size, group_size)
    grouped.mul_(scales.unsqueeze(-1))
    if offsets is not None:
        grouped.add_(offsets.unsqueeze(-1))
    return values.view(rows, cols).to(dtype)


def quant_matmul_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, dequantize_weight(...) in x's dtype, bias): x [..., K] -> [..., N]."""
    return F.linear(x, dequantize_weight(qweight, scales, offsets, bits, group_size, x.dtype), bias)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
           bits: int, *_: object) -> None:
    """What the real and the fake operator reject from metadata (besides a tensor on another
    device): a weight that is not 4- or 8-bit or whose K does not match x's."""
    if bits not in (4, 8) or qweight.shape[1] * (2 if bits == 4 else 1) != x.shape[-1]:
        raise ValueError(f"genq::quant_matmul: a {bits}-bit qweight {tuple(qweight.shape)} does not multiply x of "
                         f"{x.shape[-1]} features (bits must be 4 or 8)")


quant_matmul = entry_point(quant_matmul_reference, register(
    "quant_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor? offsets, SymInt bits, SymInt group_size, "
    "Tensor? bias=None) -> Tensor",
    dispatched(quant_matmul_reference, "triton_quant_matmul", "quant_matmul"),
    lambda x, qweight, *_: x.new_empty((*x.shape[:-1], qweight.shape[0])), _check))
