"""Opt-in int8 dynamic-quantized CPU projections: `cpu_int8` (issue 30).

Why: on CPU, fp32 matmuls over dequantized weights are a quarter of a decode
step, and fbgemm's int8 GEMM ran SmolLM2-135M's four projections of a layer
4.1x faster at 32 rows (docs/benchmarks.md). llama.cpp gets its CPU speed the
same way: its Q4_x dot products take 8-bit activations. The price is fp32
parity: greedy outputs no longer match transformers token for token, so this
is off by default and benchmarks label it apart ("genq engine (int8)").

Each projection's weight (a float nn.Linear's, or a QuantizedLinear's
dequantized fp32 weight: a GGUF Q4_x / Q8_0 file's exact values) is quantized
again, symmetric int8 per output channel (scale = row absmax / 127), and
packed once for fbgemm; every call quantizes the activations to 8 bits over
the call's own [min, max] (torch.ops.quantized.linear_dynamic) and returns
fp32. reduce_range keeps activations to 7 bits: fbgemm's AVX2 kernel adds
pairs of u8 x s8 products in int16, which 8-bit activations could overflow.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from engine.quantized_linear import QUANTIZED_PROJECTIONS, QuantizedLinear

SETTING = "cpu_int8"
# fbgemm's AVX2 int16 accumulation of u8 x s8 pairs overflows with full 8-bit activations.
_REDUCE_RANGE = True


def check_cpu_int8(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """ValueError unless a CPU device in fp32 (fbgemm's kernels are CPU-only and return fp32)."""
    if device.type != "cpu":
        raise ValueError(f"{SETTING}=True runs int8 projections with fbgemm, CPU only: device {device} is not a CPU "
                         f"(leave {SETTING} off on {device.type})")
    if dtype is not None and dtype != torch.float32:
        raise ValueError(f"{SETTING}=True needs a float32 model (fbgemm returns fp32), got {dtype}")


class Int8DynamicLinear(nn.Module):
    """y = x @ W^T + bias with W int8 per output channel and x quantized to 8 bits per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        check_cpu_int8(weight.device)
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scales = w.abs().amax(dim=1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        with warnings.catch_warnings():
            # torch 2.13 deprecates quantized tensors, but linear_prepack takes nothing else yet
            warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
            qweight = torch.quantize_per_channel(w, scales.double(), zero_points, 0, torch.qint8)
        float_bias = bias.detach().float() if bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack(qweight, float_bias)

    @classmethod
    def from_linear(cls, layer: nn.Linear | QuantizedLinear) -> Int8DynamicLinear:
        """From a float layer's weight, or a quantized layer's weight as its kernels see it."""
        weight = layer.dequantized_weight(torch.float32) if isinstance(layer, QuantizedLinear) else layer.weight
        return cls(weight, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, _REDUCE_RANGE)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic (fbgemm)"


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
