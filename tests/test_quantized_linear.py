"""Weight-only int8 / int4 linear layers (engine/quantized_linear.py) and the
quantized matmul kernels (kernels/quant_matmul.py, kernels/triton_quant_matmul.py):
every CPU path and the Triton kernel (in its interpreter) against the torch
reference, quantization error within its bound, and GGUF's 4- and 8-bit
blocks mapped onto the formats bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.gguf_dequant import dequantize, to_quantized
from engine.quantized_linear import QuantizedLinear, QuantizedWeight, quantize_linears, quantize_weight
from kernels.quant_matmul import pack_int4, quant_matmul_reference, unpack_int4
from tests.gguf_files import encode_tensor

ROOT = Path(__file__).resolve().parent.parent


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_packing_puts_even_columns_in_the_low_nibble():
    values = torch.tensor([[1, 2, 15, 0, 7, 8]])
    packed = pack_int4(values)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(unpack_int4(packed), values.to(torch.uint8))


@pytest.mark.parametrize(("quantize", "group_size"), [("int8", None), ("int8", 32), ("int4", 32), ("int4", 128)])
def test_round_to_nearest_error_is_at_most_half_a_step(quantize: str, group_size: int | None):
    weight = _weight(48, 256)
    q = quantize_weight(weight, quantize, group_size)
    group = group_size or 256
    assert q.scales.shape == (48, 256 // group)
    step = q.scales.repeat_interleave(group, dim=1)
    error = (q.dequantize() - weight).abs()
    assert (error <= step / 2 + 1e-7).all()
    # the range is used: a step much smaller than the group's spread would clip, much larger would waste bits
    levels = 254 if quantize == "int8" else 15
    spread = weight.reshape(48, -1, group).abs().amax(-1) * 2 if quantize == "int8" else (
        weight.reshape(48, -1, group).amax(-1) - weight.reshape(48, -1, group).amin(-1))
    torch.testing.assert_close(q.scales, spread / levels)


def test_a_constant_group_is_exact():
    weight = torch.full((16, 64), 0.25)
    weight[:, 32:] = 0.0
    for quantize in ("int8", "int4"):
        assert torch.equal(quantize_weight(weight, quantize, 32).dequantize(), weight)


def _layers(quantize: str, dtype: torch.dtype, bias: bool) -> tuple[torch.nn.Linear, QuantizedLinear, QuantizedWeight]:
    linear = torch.nn.Linear(256, 96, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(_weight(96, 256, seed=1))
        if bias:
            linear.bias.normal_(generator=torch.Generator().manual_seed(2))
    linear = linear.to(dtype)
    layer = QuantizedLinear.from_weight(quantize_weight(linear.weight, quantize),
                                        linear.bias.detach() if bias else None, dtype)
    return linear, layer, quantize_weight(linear.weight, quantize)



@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_cpu_paths_match_the_reference_and_the_full_linear(quantize: str, dtype: torch.dtype, bias: bool):
    """Each dtype's CPU kernel (scale-after F.linear, aten int8pack, aten int4pack on its
    own layout, the reference) against dequantize -> F.linear, and the layer against the
    unquantized one within the quantization error."""
    linear, layer, weight = _layers(quantize, dtype, bias)
    expected_layout = "cpu_int4pack" if quantize == "int4" and dtype == torch.bfloat16 else "rows"
    assert layer.layout == expected_layout
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = layer(x)
    reference = quant_matmul_reference(x, weight.qweight, weight.scales, weight.offsets, weight.bits,
                                       weight.group_size, linear.bias)
    assert got.shape == (3, 5, 96) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, reference, atol=tolerance, rtol=tolerance)
    # the layer's weights are the quantized ones, whatever the layout (aten's int4pack keeps
    # its scales and zeros in the activations' dtype: a rounding of those apart)
    exact = dtype == torch.float32
    torch.testing.assert_close(layer.dequantized_weight(torch.float32), weight.dequantize(dtype).float(),
                               atol=0 if exact else 2e-3, rtol=0 if exact else 1e-2)
    # within the quantization error of the full layer, and far from it without the weights
    full = linear(x).float()
    error = (got.float() - full).abs().max().item()
    bound = {"int8": 0.02, "int4": 0.12}[quantize] * full.abs().max().item()
    assert error < bound, (error, bound)
    assert (quant_matmul_reference(x, weight.qweight, weight.scales * 0.5, weight.offsets, weight.bits,
                                   weight.group_size, linear.bias).float() - full).abs().max() > bound


def test_int4_group_size_and_format_are_checked():
    with pytest.raises(ValueError, match=r"int4 group_size=48 is not supported; use one of 32, 64, 128"):
        QuantizedLinear(256, 16, "int4", group_size=48)
    with pytest.raises(ValueError, match=r"quantize='int2' is not supported; use one of int8, int4"):
        QuantizedLinear(256, 16, "int2")
    with pytest.raises(ValueError, match=r"group_size=64 does not divide in_features=96"):
        QuantizedLinear(96, 16, "int4", group_size=64)
    layer = QuantizedLinear(64, 16, "int4")
    with pytest.raises(ValueError, match="group_size=32 and 64"):
        layer.load_rows(0, quantize_weight(_weight(16, 64), "int4", 64))


def test_quantize_linears_swaps_only_the_named_projections():
    model = torch.nn.ModuleDict({
        "attn": torch.nn.ModuleDict({"qkv_proj": torch.nn.Linear(64, 96), "o_proj": torch.nn.Linear(32, 64)}),
        "lm_head": torch.nn.Linear(64, 100),
    })
    with torch.device("meta"):
        meta = torch.nn.ModuleDict({"down_proj": torch.nn.Linear(64, 64, bias=False)})
    assert quantize_linears(model, "int8") == ["attn.qkv_proj", "attn.o_proj"]
    assert isinstance(model["attn"]["qkv_proj"], QuantizedLinear) and type(model["lm_head"]) is torch.nn.Linear
    assert model["attn"]["qkv_proj"].bias is not None
    assert quantize_linears(meta, "int4") == ["down_proj"] and meta["down_proj"].qweight.is_meta
    with pytest.raises(ValueError, match="attn.o_proj cannot be quantized to int4.*does not divide in_features=48"):
        quantize_linears(torch.nn.ModuleDict({"attn": torch.nn.ModuleDict({"o_proj": torch.nn.Linear(48, 8)})}),
                         "int4")


# -- GGUF blocks --------------------------------------------------------------


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_map_exactly_onto_the_quantized_format(kind: Q):
    """The packed weight built from the raw blocks dequantizes to exactly the floats
    engine/gguf_dequant.dequantize expands, and the layer computes F.linear with them."""
    rng = np.random.default_rng(int(kind))
    values = rng.standard_normal((32, 512)).astype(np.float32)
    raw = encode_tensor(values, kind, rng)
    quantize = "int8" if kind == Q.Q8_0 else "int4"
    weight = to_quantized(raw, kind, values.shape, quantize)
    assert weight is not None and weight.format == quantize and weight.group_size == 32
    expected = dequantize(raw, kind, values.shape, torch.float32)
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        layer = QuantizedLinear.from_weight(weight, dtype=dtype)
        want = F.linear(x.to(dtype), expected.to(dtype)).float()
        error = (layer(x.to(dtype)).float() - want).abs().max().item()
        assert error <= tolerance * want.abs().max().item(), (dtype, error)


def test_gguf_types_without_an_exact_mapping_are_left_to_requantization():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 256)).astype(np.float32)
    for kind, quantize in ((Q.Q8_0, "int4"), (Q.Q5_K, "int4"), (Q.Q4_1, "int8"), (Q.F16, "int8")):
        assert to_quantized(encode_tensor(values, kind, rng), kind, values.shape, quantize) is None


# -- Triton ---------------------------------------------------------------------

TRITON_CHECK = r"""
import sys, torch
import kernels.quant_matmul as qm
from engine.quantized_linear import QuantizedLinear, quantize_weight
g = torch.Generator().manual_seed(0)
cases = 0
for bits, group in ((4, 32), (4, 64), (8, 32), (8, None)):
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for m, k, n, bias in ((1, 64, 48, False), (5, 128, 40, True), (19, 192, 33, True)):
            w = torch.randn(n, k, generator=g) * 0.05
            q = quantize_weight(w, "int4" if bits == 4 else "int8", group)
            x = torch.randn(m, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            want = qm.quant_matmul_reference(x, q.qweight, q.scales, q.offsets, bits, q.group_size, b)
            got = qm.quant_matmul(x, q.qweight, q.scales, q.offsets, bits, q.group_size, b)
            err = (got.float() - want.float()).abs().max().item()
            assert got.dtype == dtype and got.shape == want.shape
            assert err <= tol * max(1.0, want.abs().max().item()), (bits, group, dtype, m, k, n, err)
            cases += 1
assert "kernels.triton_quant_matmul" in sys.modules
layer = QuantizedLinear.from_weight(quantize_weight(torch.randn(64, 64, generator=g), "int4"), dtype=torch.bfloat16)
assert layer.layout == "rows"  # the Triton path reads the row layout, not aten's CPU one
x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
torch.testing.assert_close(layer(x), qm.quant_matmul_reference(x, layer.qweight, layer.scales, layer.offsets, 4, 32))
print(cases, "cases")
"""


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    """GENQ_FORCE_TRITON=1 on CPU tensors: the kernel runs in Triton's interpreter (set
    before triton is imported, so in a fresh process) and QuantizedLinear takes it."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GENQ_FORCE_TRITON")}
    env.update(GENQ_FORCE_TRITON="1", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "24 cases"


def compile_quant_matmul_kernels() -> None:
    """Compile the dequantize-matmul kernel for sm_90 (bf16 activations): int4 with offsets and
    int8, at the decode and the prefill tile shapes; run with TRITON_INTERPRET unset."""
    from kernels import triton_quant_matmul as tq
    from tests.kernel_compile_check import compile_one

    for bits, weights in ((4, "*u8"), (8, "*i8")):
        for block_m, block_n, block_k in ((16, 64, 128), (64, 64, 64)):
            signature = {"x_ptr": "*bf16", "q_ptr": weights, "s_ptr": "*fp32", "o_ptr": "*fp32", "b_ptr": "*bf16",
                         "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                         "stride_qn": "i32", "stride_sn": "i32", "stride_om": "i32"}
            compile_one(f"quant_matmul int{bits} {block_m}x{block_n}x{block_k}", tq._quant_matmul_kernel, signature,
                        {"GROUP": 32, "BITS": bits, "HAS_OFFSETS": bits == 4, "HAS_BIAS": True, "IEEE": False,
                         "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k})


def test_the_dequantize_matmul_kernel_compiles_for_an_sm90_gpu_without_one() -> None:
    from tests.test_kernels import run_python

    code = "from tests.test_quantized_linear import compile_quant_matmul_kernels; compile_quant_matmul_kernels()"
    out = run_python(["-c", code], {})
    assert out.count("compiled for sm_90") == 4, out
