"""Weight-only int8 / int4 linear layers (issue 13).

Why: decode reads every weight once per step, so a model's weight bytes
bound its speed on a GPU and its size bounds what fits; 4-bit weights are an
eighth of fp32's bytes (with group scales and offsets, 6 bits per weight:
0.19x fp32, 0.38x bf16). Activations stay in the model's dtype: only the
weights are quantized, and every path rounds the dequantized weights to the
activations' dtype before the matmul, as a dequantize-then-F.linear would.

Formats (the layout is kernels/quant_matmul.py's):

- int8: symmetric, q in [-127, 127], w = q * scale; per output channel by
  default (one scale per row), or per group (GGUF's Q8_0 maps on group 32);
- int4: asymmetric, q in [0, 15], w = q * scale + offset per group of
  group_size columns (32, 64 or 128; 32 by default so that llama.cpp's
  Q4_0, Q4_1 and Q4_K blocks map onto it exactly, engine/gguf_dequant.py).

Scales and offsets are fp32: Q4_K's per-sub-block scale is an fp16 times a
6-bit integer, which fp16 or bf16 cannot hold exactly.

Kernels, by device and dtype (the choice is made once per layer, at load):

- CUDA, or GENQ_FORCE_TRITON=1 (Triton's interpreter on CPU): the Triton
  dequantize-matmul kernel (kernels/triton_quant_matmul.py);
- CPU: whichever was fastest on the development machine (AMD EPYC, AVX2, no
  AVX-512 / VNNI / AMX), measured by bench/quantized_linear.py (one thread,
  best of 5 runs, load average about 2 on the 2 cores) over SmolLM2-135M's
  four projections (576 -> 960, 576 -> 576, 576 -> 3072, 1536 -> 576);
  microseconds for all four, by batch rows:

                           batch 1   batch 32   batch 256
    fp32  full (unquant.)      367      3 565      23 286
          int8 dequantize    1 099      4 420      25 594
          int8 scale-after     746      3 951      25 055   <- fp32 int8
          int8 aten int8pack 3 522    116 904  1 027 292
          int4 dequantize    2 780      6 752      28 730   <- fp32 int4
          int4 aten int4pack 7 459    237 913  1 938 901
    bf16  full (unquant.)      815     23 698     192 614
          int8 dequantize    2 495     26 767     194 047
          int8 aten int8pack   349      5 536      48 445   <- bf16 int8
          int4 dequantize    4 426     28 798     197 044
          int4 aten int4pack   554      5 917      47 338   <- bf16 int4
    fp16  full (unquant.)      619     20 097     179 042
          int8 dequantize    2 149     22 906     163 930   <- fp16 int8
          int8 aten int8pack 3 763    116 788     958 638
          int4 dequantize    4 094     25 081     184 728   <- fp16 int4
          int4 aten int4pack 7 524    250 781  2 099 539

  aten's int8pack / int4pack kernels are vectorized for bf16 activations
  only (fp32 and fp16 take a scalar loop whose cost grows with the batch:
  prefill chunks have hundreds of rows), and there they beat even torch's
  own bf16 GEMM, which is slow on this CPU. Hence: bf16 uses them; int8 per
  channel in fp32 runs F.linear on the int8 weights cast to fp32 and scales
  the output ("scale-after": a row's scale factors out of its dot product;
  not in fp16, where x @ q^T could overflow); everything else dequantizes
  (one fp32 buffer, in place) and calls F.linear, so on CPU weight-only
  quantization buys memory, not speed, except in bf16. Per SmolLM2-135M
  decode step (its Q4_1 GGUF in fp32, 64 tokens of context, one thread):
  quantize=None 75 ms at batch 1 / 201 ms at batch 16, int8 (group 32, from
  the GGUF) 102 / 226 ms, int4 154 / 260 ms; linear weights 405 / 114 /
  76 MiB. Rounding fp32 activations to bf16 to use aten's int4 kernel anyway
  measured 59 / 178 ms instead of 144 / 278 ms, but that is no longer
  weight-only quantization (nor exact for Q4_1 files): not done. The
  int4pack kernel reads its own tiled
  layout (_convert_weight_to_int4pack_for_cpu, value = (q - 8) * scale +
  zero, scales_and_zeros [K / G, N, 2]), so such a layer keeps only that
  layout (zero = offset + 8 * scale, both rounded to bf16).
- anything else: the torch reference (dequantize, then F.linear).

Loading (engine/weights.py) builds the model on the meta device, swaps the
attention and MLP projections for QuantizedLinear with quantize_linears(),
allocates only the packed buffers, and quantizes each checkpoint tensor as
it streams in. Quantization is per row (per output channel, or per row and
group), so quantizing q, k and v (or gate and up) one at a time into their
rows of the fused projection gives exactly what quantizing the fused matrix
would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels import triton_enabled
from kernels.quant_matmul import dequantize_weight, pack_int4, quant_matmul, unpack_int4

QUANTIZE_FORMATS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32
# The projections quantize_linears() swaps: attention's and the dense MLP's.
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

_BITS = {"int8": 8, "int4": 4}
# The activation dtypes for which aten's int8pack / int4pack CPU kernels were the faster choice.
_ATEN_CPU_DTYPES = (torch.bfloat16,)
# _convert_weight_to_int4pack_for_cpu's inner K tiles, and its rule on the row count.
_INT4PACK_INNER_K_TILES = 2
_INT4PACK_ROW_MULTIPLE = 16


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix [out_features, in_features] in kernels/quant_matmul.py's format."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def format(self) -> str:
        return "int4" if self.bits == 4 else "int8"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.scales, self.offsets, self.bits, self.group_size, dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with fn (a reordering of rows) applied to every row-major field."""
        offsets = fn(self.offsets) if self.offsets is not None else None
        return replace(self, qweight=fn(self.qweight), scales=fn(self.scales), offsets=offsets)


def check_format(quantize: str, group_size: int | None = None) -> None:
    """Raise ValueError naming the allowed values for a bad format or group size."""
    if quantize not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize={quantize!r} is not supported; use one of {', '.join(QUANTIZE_FORMATS)}")
    if quantize == "int4" and group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"int4 group_size={group_size} is not supported; use one of {', '.join(map(str, INT4_GROUP_SIZES))}"
        )
    if quantize == "int8" and group_size is not None and group_size < 1:
        raise ValueError(f"int8 group_size={group_size} must be positive (None: one scale per output channel)")


def _group_size(quantize: str, group_size: int | None, in_features: int) -> int:
    """The effective group size: int8's None means the whole row."""
    check_format(quantize, group_size)
    if group_size is None:
        group_size = DEFAULT_INT4_GROUP_SIZE if quantize == "int4" else in_features
    if in_features % group_size:
        raise ValueError(f"{quantize} group_size={group_size} does not divide in_features={in_features}")
    return group_size


def quantize_weight(weight: torch.Tensor, quantize: str, group_size: int | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a float [N, K] matrix: int8 symmetric
    (scale = absmax / 127), int4 asymmetric over each group's [min, max]
    (scale = (max - min) / 15, offset = min). Computed in fp32."""
    rows, cols = weight.shape
    group = _group_size(quantize, group_size, cols)
    grouped = weight.detach().float().reshape(rows, cols // group, group)
    if quantize == "int8":
        scales = grouped.abs().amax(dim=-1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(grouped / scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q.reshape(rows, cols), scales, None, 8, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = (high - low) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((grouped - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15)
    return QuantizedWeight(pack_int4(q.reshape(rows, cols)), scales, low, 4, group)


class QuantizedLinear(nn.Module):
    """y = x @ W^T + bias with W quantized (weight-only; x and y in `dtype`).

    Build it empty (then load_rows() and finalize(), as the loader does) or
    from_weight(). Its buffers are qweight, scales and offsets
    in the "rows" layout; finalize() may switch a CPU layer to aten's int4pack
    layout ("cpu_int4pack": qweight tiled, scales_and_zeros [K / G, N, 2] in
    `dtype`), which only that kernel reads."""

    # buffers (register_buffer in __init__); finalize() to "cpu_int4pack" swaps
    # scales and offsets for scales_and_zeros
    qweight: torch.Tensor
    scales: torch.Tensor | None
    offsets: torch.Tensor | None  # int4 only
    scales_and_zeros: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        quantize: str,
        group_size: int | None = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantize = quantize
        self.group_size = _group_size(quantize, group_size, in_features)
        self.bits = _BITS[quantize]
        self.dtype = dtype or torch.get_default_dtype()
        self.layout = "rows"
        packed_cols = in_features // 2 if self.bits == 4 else in_features
        groups = in_features // self.group_size
        qdtype = torch.uint8 if self.bits == 4 else torch.int8
        self.register_buffer("qweight", torch.empty(out_features, packed_cols, dtype=qdtype, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32, device=device))
        offsets = torch.empty(out_features, groups, dtype=torch.float32, device=device) if self.bits == 4 else None
        self.register_buffer("offsets", offsets)
        self.register_buffer("scales_and_zeros", None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=self.dtype, device=device)) if bias else None

    @classmethod
    def from_weight(
        cls, weight: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> QuantizedLinear:
        """A finalized layer holding `weight` (and a copy of bias), computing in dtype (bias's by default)."""
        dtype = dtype or (bias.dtype if bias is not None else None)
        layer = cls(weight.in_features, weight.out_features, weight.format, weight.group_size,
                    bias=bias is not None, dtype=dtype, device=weight.qweight.device)
        layer.load_rows(0, weight)
        if bias is not None and layer.bias is not None:
            layer.bias.data.copy_(bias)
        layer.finalize()
        return layer

    def load_rows(self, start: int, weight: torch.Tensor | QuantizedWeight) -> None:
        """Fill rows [start, start + rows) from a float matrix (quantized here) or a
        QuantizedWeight of this layer's format and group size."""
        if self.layout != "rows":
            raise RuntimeError("load_rows() after finalize(): the weights are in a kernel's own layout")
        if not isinstance(weight, QuantizedWeight):
            if weight.dim() != 2 or weight.shape[1] != self.in_features:
                raise ValueError(f"a weight of shape {tuple(weight.shape)} for {self.in_features} input features")
            weight = quantize_weight(weight, self.quantize, self.group_size)
        if (weight.bits, weight.group_size, weight.in_features) != (self.bits, self.group_size, self.in_features):
            raise ValueError(
                f"a {weight.format} weight with group_size={weight.group_size} and {weight.in_features} input "
                f"features for a {self.quantize} layer with group_size={self.group_size} and {self.in_features}"
            )
        if not 0 <= start <= start + weight.out_features <= self.out_features:
            raise ValueError(f"rows {start}..{start + weight.out_features} of a {self.out_features}-row layer")
        rows = slice(start, start + weight.out_features)
        self.qweight[rows] = weight.qweight
        self._row_scales()[rows] = weight.scales
        if self.offsets is not None and weight.offsets is not None:
            self.offsets[rows] = weight.offsets

    def finalize(self) -> None:
        """Lay the weights out for the kernel this layer's device and dtype take (see
        the module docstring); call once, after every row is loaded."""
        if self.layout == "rows" and self._uses_int4pack():
            scales, offsets = self._row_scales(), self.offsets
            assert offsets is not None, "an int4 layer has offsets"
            q = unpack_int4(self.qweight).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INT4PACK_INNER_K_TILES)
            zeros = offsets + 8 * scales
            self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(
                self.dtype)
            self.qweight, self.scales, self.offsets = packed, None, None
            self.layout = "cpu_int4pack"

    def _row_scales(self) -> torch.Tensor:
        """scales [N, K / G] of the "rows" layout (the only layout that keeps them)."""
        assert self.scales is not None, f"no per-row scales in the {self.layout} layout"
        return self.scales

    def _uses_int4pack(self) -> bool:
        return (
            self.bits == 4
            and self.qweight.device.type == "cpu"
            and self.dtype in _ATEN_CPU_DTYPES
            and self.out_features % _INT4PACK_ROW_MULTIPLE == 0
            and not triton_enabled(self.qweight)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "cpu_int4pack":
            if x.device.type != "cpu":
                raise RuntimeError("this layer holds aten's CPU int4 layout: load the model on the device it runs on")
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                _rows(x), self.qweight, self.group_size, self.scales_and_zeros)
            return _with_bias(out, self.bias).reshape(*x.shape[:-1], self.out_features)
        per_channel_int8 = self.bits == 8 and self.group_size == self.in_features
        if per_channel_int8 and x.device.type == "cpu" and not triton_enabled(x):
            scales = self._row_scales().squeeze(1).to(x.dtype)
            if x.dtype in _ATEN_CPU_DTYPES:
                out = torch.ops.aten._weight_int8pack_mm(_rows(x), self.qweight, scales)
                return _with_bias(out, self.bias).reshape(*x.shape[:-1], self.out_features)
            if x.dtype == torch.float32:
                # a row's scale factors out of its dot product (fp16 is left out: x @ q^T could overflow it)
                return _with_bias(F.linear(x, self.qweight.to(x.dtype)) * scales, self.bias)
        return quant_matmul(x, self.qweight, self._row_scales(), self.offsets, self.bits, self.group_size, self.bias)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [out_features, in_features] as the kernels see it (for tests and inspection)."""
        dtype = dtype or self.dtype
        if self.layout == "cpu_int4pack":
            # the kernel applied to the identity yields W^T: each output is one weight times 1
            eye = torch.eye(self.in_features, dtype=self.dtype, device=self.qweight.device)
            columns = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.qweight, self.group_size, self.scales_and_zeros)
            return columns.t().to(dtype)
        return dequantize_weight(self.qweight, self._row_scales(), self.offsets, self.bits, self.group_size, dtype)

    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (and offsets), bias excluded."""
        tensors = (self.qweight, self.scales, self.offsets, self.scales_and_zeros)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, quantize={self.quantize}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, layout={self.layout}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous 2-D [rows, features] matrix, as the aten kernels need."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out + bias if bias is not None else out


def quantize_linears(model: nn.Module, quantize: str, group_size: int | None = None) -> list[str]:
    """Swap every nn.Linear whose attribute name is in QUANTIZED_PROJECTIONS for an empty
    QuantizedLinear on the same device (meta included) and dtype; returns the
    swapped modules' qualified names. Fill them with load_rows(), then finalize()."""
    check_format(quantize, group_size)
    swapped: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name not in QUANTIZED_PROJECTIONS or type(child) is not nn.Linear:
                continue
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            try:
                layer = QuantizedLinear(child.in_features, child.out_features, quantize, group_size,
                                        bias=child.bias is not None, dtype=child.weight.dtype,
                                        device=child.weight.device)
            except ValueError as exc:
                raise ValueError(f"{qualified} cannot be quantized to {quantize}: {exc}") from exc
            setattr(parent, child_name, layer)
            swapped.append(qualified)
    return swapped
