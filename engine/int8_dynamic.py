"""Opt-in int8 dynamic-quantized CPU projections: `cpu_int8` (issue 30).

Why: on CPU, fp32 matmuls over dequantized weights are a quarter of a decode
step, and fbgemm's int8 GEMM ran SmolLM2-135M's four projections of a layer
4.1x faster at 32 rows (docs/benchmarks.md). llama.cpp gets its CPU speed the
same way: its Q4_x dot products take 8-bit activations. The price is fp32
parity: greedy outputs no longer match transformers token for token, so this
is off by default and benchmarks label it apart ("genq engine (int8)").

Each projection's weight (a float nn.Linear's, or a QuantizedLinear's
dequantized fp32 weight: a GGUF Q4_x / Q8_0 file's exact values) is quantized
again, symmetric int8 per output channel (scale = row absmax / 127), once;
every call quantizes each activation row (token) the same way, multiplies in
int8 with exact int32 sums (torch._int_mm, oneDNN on x86) and scales the
result by the row's and the output channel's scales.

Why per row: fbgemm's linear_dynamic (4.1x, the figure above) quantizes the
whole call's activations over one range, and SmolLM2's outlier channels
then leave the other channels a few levels: its logits were 81% off (relative
RMS, top-1 agreeing at 66% of positions over a 32-token English prompt);
per row they are 21% off (top-1 94%), at 3.0x the four projections' fp32
speed instead of 4.1x (32 rows, one thread). llama.cpp's per-32-value blocks
would be closer still, but torch has no grouped int8 matmul to run them.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantized_linear import QUANTIZED_PROJECTIONS, QuantizedLinear

SETTING = "cpu_int8"


def check_cpu_int8(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """ValueError unless a CPU device in fp32 (the int8 matmul runs on CPU here and returns fp32)."""
    if device.type != "cpu":
        raise ValueError(f"{SETTING}=True runs int8 projections on the CPU only: device {device} is not a CPU "
                         f"(leave {SETTING} off on {device.type})")
    if dtype is not None and dtype != torch.float32:
        raise ValueError(f"{SETTING}=True needs a float32 model (its int8 projections return fp32), got {dtype}")


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] as int8 and a scale per row (absmax / 127; 1 for an all-zero row)."""
    scales = x.abs().amax(dim=1, keepdim=True) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(x / scales).to(torch.int8), scales


class Int8DynamicLinear(nn.Module):
    """y = x @ W^T + bias with W int8 per output channel and x quantized to int8 per row, per call."""

    # buffers (register_buffer in __init__)
    qweight_t: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        check_cpu_int8(weight.device)
        self.out_features, self.in_features = weight.shape
        qweight, scales = _int8_rows(weight.detach().float())
        self.register_buffer("qweight_t", qweight.t().contiguous())  # [K, N], as torch._int_mm takes it
        self.register_buffer("scales", scales.squeeze(1))
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else None)

    @classmethod
    def from_linear(cls, layer: nn.Linear | QuantizedLinear) -> Int8DynamicLinear:
        """From a float layer's weight, or a quantized layer's weight as its kernels see it."""
        weight = layer.dequantized_weight(torch.float32) if isinstance(layer, QuantizedLinear) else layer.weight
        return cls(weight, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qx, row_scales = _int8_rows(x.reshape(-1, self.in_features))
        out = torch._int_mm(qx, self.qweight_t).float() * row_scales * self.scales
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel x int8 per row"


def int8_dynamic_linears(model: nn.Module) -> list[str]:
    """Swap every projection named in QUANTIZED_PROJECTIONS (float or weight-only quantized) for an
    Int8DynamicLinear; returns the swapped modules' qualified names."""
    swapped: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name not in QUANTIZED_PROJECTIONS or not isinstance(child, (nn.Linear, QuantizedLinear)):
                continue
            setattr(parent, child_name, Int8DynamicLinear.from_linear(child))
            swapped.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return swapped
