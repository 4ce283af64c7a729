"""cpu_int8 (engine/int8_dynamic.py): int8 dynamic projections within int8 rounding error of the
fp32 layer they replace, for float and GGUF-quantized weights; a greedy run with the option
finishes every job; the option refused off the CPU, by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from engine import Generator, Job
from engine.gguf_dequant import to_quantized
from engine.int8_dynamic import Int8DynamicLinear
from engine.quantized_linear import QuantizedLinear
from worker.settings import Settings

# SmolLM2-135M's projection shapes (in, out): qkv, o, gate_up, down.
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
# Relative RMS error of y = x W^T: weights rounded per row to absmax / 127 and activations per
# row the same way; a row of K >= 576 Gaussians has an absmax of about 3.3 sigma, so each rounds
# with 3.3 / 127 / sqrt(12) = 0.75% RMS, and the two add up to about 1.1% (measured 0.9-1.15%
# here). 2% leaves room for the Q4 rows' uneven weights without letting a wrong scale or a
# dropped bias through.
INT8_RELATIVE_ERROR = 0.02


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_float_layer_with_bias_is_within_int8_error(in_features: int, out_features: int):
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features)
    x = torch.randn(32, in_features)
    with torch.no_grad():
        reference = layer(x)
        out = Int8DynamicLinear.from_linear(layer)(x)
    assert out.shape == reference.shape and out.dtype == torch.float32
    assert 0 < relative_error(out, reference) < INT8_RELATIVE_ERROR


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_gguf_layer_is_within_int8_error_of_its_fp32_dequantized_weight(kind: Q, in_features: int,
                                                                         out_features: int):
    rng = np.random.default_rng(0)
    raw = quants.quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), kind)
    weight = to_quantized(raw, kind, (out_features, in_features), "int8" if kind == Q.Q8_0 else "int4")
    assert weight is not None
    layer = QuantizedLinear.from_weight(weight, dtype=torch.float32)
    x = torch.randn(32, in_features, generator=torch.Generator().manual_seed(1))
    reference = F.linear(x, layer.dequantized_weight(torch.float32))
    out = Int8DynamicLinear.from_linear(layer)(x)
    assert 0 < relative_error(out, reference) < INT8_RELATIVE_ERROR


def test_greedy_run_with_cpu_int8_finishes_every_job(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8, cpu_int8=True)
    swapped = [m for m in generator.model.modules() if isinstance(m, Int8DynamicLinear)]
    assert len(swapped) == 4 * generator.model.config.num_layers
    lengths = {0: 7, 1: 15, 2: 30}
    for identifier, new_tokens in lengths.items():
        generator.enqueue(Job(list(range(5, 25 + identifier)), new_tokens, stop_conditions=[], identifier=identifier))
    finals = {}
    while generator.num_remaining_jobs():
        finals.update({r["identifier"]: r for r in generator.iterate() if r["eos"]})
    assert {i: (r["eos_reason"], len(r["completion_ids"])) for i, r in finals.items()} == {
        i: ("max_new_tokens", n) for i, n in lengths.items()}


def test_cpu_int8_is_refused_on_cuda_by_name(llama_dir: Path):
    with pytest.raises(ValueError, match="cpu_int8=True .* device cuda is not a CPU"):
        Generator.from_pretrained(llama_dir, device="cuda", cpu_int8=True)
    with FakeTensorMode():
        weight = torch.empty(16, 16, device="cuda")
    with pytest.raises(ValueError, match="cpu_int8=True .* device cuda:0 is not a CPU"):
        Int8DynamicLinear(weight)
    with pytest.raises(ValueError, match="GENQ_CPU_INT8: .* CPU only, not GENQ_DEVICE=cuda"):
        Settings(device="cuda", cpu_int8=True)


def test_cpu_int8_is_refused_for_a_bfloat16_model(llama_dir: Path):
    with pytest.raises(ValueError, match="cpu_int8=True needs a float32 model"):
        Generator.from_pretrained(llama_dir, dtype=torch.bfloat16, cpu_int8=True)
