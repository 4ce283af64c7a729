"""load_model(quantize="int8" | "int4"): full-precision checkpoints quantized
as their tensors stream in (fused projections included), GGUF blocks mapped
onto the quantized layers without being expanded, and bad settings refused by
name. The real model in int4: tests/test_quantized_real_model.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

import engine.gguf_file
from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.errors import ModelLoadError
from engine.model import CausalLM
from engine.quantized_linear import QuantizedLinear, quantize_weight
from engine.weights import load_model
from genq_dev.tiny_model import make_tiny_model
from tests.gguf_files import write_gguf

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Row lengths a multiple of 256, as the K-quants need.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_scaling": None}


def all_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of one sequence, every position, in one forward."""
    n = len(ids)
    page = 16
    pages = -(-n // page)
    model.bind_cache(KVCache.allocate(model.config, pages, page, model.embed_tokens.weight.dtype, "cpu"))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(n),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        page_table=torch.arange(pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n),
        logits_indices=torch.arange(n),
    )
    return model(batch)


def quantized_layers(model: CausalLM) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def linear_weight_bytes(model: CausalLM) -> int:
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_bytes()
        elif name.endswith(PROJECTIONS):
            total += module.weight.numel() * module.weight.element_size()
    return total


# -- full-precision checkpoints -------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_logits_are_close_to_full_precision(family: str, tiny_model_factory: Callable[..., Path]):
    path = tiny_model_factory(family)
    full, int8, int4 = load_model(path), load_model(path, quantize="int8"), load_model(path, quantize="int4")
    layers = quantized_layers(int8)
    assert sorted({name.rsplit(".", 1)[1] for name in layers}) == sorted(PROJECTIONS)
    assert len(layers) == 4 * full.config.num_layers
    assert type(int8.lm_head) is torch.nn.Linear and type(int8.embed_tokens) is torch.nn.Embedding
    ids = list(range(3, 40))
    reference = all_logits(full, ids)
    # relative RMS error of the logits; the tiny models' sharp random attention amplifies the
    # weights' (int8: 0.6%, int4 with group 32: 8%) to about 4% and 40%
    error8 = ((all_logits(int8, ids) - reference).norm() / reference.norm()).item()
    error4 = ((all_logits(int4, ids) - reference).norm() / reference.norm()).item()
    assert 0 < error8 < 0.06, error8
    assert 4 * error8 < error4 < 0.6, (error8, error4)
    assert linear_weight_bytes(int8) < 0.27 * linear_weight_bytes(full)  # 1 byte a weight + an fp32 scale a row


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_fused_projections_hold_each_checkpoint_tensor_quantized_in_its_rows(
    quantize: str, tiny_model_factory: Callable[..., Path]
):
    """q/k/v (with Qwen2's biases) and gate/up quantized one tensor at a time into their rows
    of the fused layer: the same as quantizing each on its own, in HF's order."""
    path = tiny_model_factory("qwen2")
    tensors = load_file(str(path / "model.safetensors"))
    layer = load_model(path, quantize=quantize).layers[1]
    prefix = "model.layers.1."
    for fused, parts in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                         (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj"))):
        expected = torch.cat([quantize_weight(tensors[f"{prefix}{p}.weight"], quantize).dequantize() for p in parts])
        assert torch.equal(fused.dequantized_weight(torch.float32), expected)
    assert torch.equal(layer.self_attn.qkv_proj.bias.data, torch.cat(
        [tensors[f"{prefix}self_attn.{p}_proj.bias"] for p in "qkv"]))


def test_moe_experts_stay_in_full_precision_with_a_warning(
    hf_model_factory: Callable[..., Path], caplog: pytest.LogCaptureFixture
):
    path = hf_model_factory("MixtralConfig", num_local_experts=4, num_experts_per_tok=2)
    full = load_model(path)
    with caplog.at_level(logging.WARNING, logger="engine.weights"):
        int8 = load_model(path, quantize="int8")
    assert "leaves the 4 MoE experts" in caplog.text
    attention = {f"layers.{i}.self_attn.{p}" for i in range(full.config.num_layers) for p in ("qkv_proj", "o_proj")}
    assert set(quantized_layers(int8)) == attention
    experts = int8.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, full.layers[0].mlp.experts.gate_up_proj)
    ids = list(range(5, 30))
    reference = all_logits(full, ids)
    # transformers' initialisation here (initializer_range 0.2) makes attention sharper still
    assert 0 < (all_logits(int8, ids) - reference).norm() / reference.norm() < 0.15


# -- bad settings ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["int3", "INT4", "fp8", True])
def test_a_bad_quantize_value_is_named_with_the_allowed_ones(value: object, llama_dir: Path):
    with pytest.raises(ModelLoadError, match=r"quantize=.* is not supported; use None .*'int8' or 'int4'"):
        load_model(llama_dir, quantize=value)  # type: ignore[arg-type]


def test_int4_on_rows_that_groups_of_32_do_not_divide_is_refused_by_layer(tmp_path: Path):
    path = make_tiny_model(tmp_path, "llama", hidden_size=48, head_dim=12, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"quantize='int4': layers.0.self_attn.qkv_proj cannot be quantized to "
                                             r"int4: int4 group_size=32 does not divide in_features=48"):
        load_model(path, quantize="int4")
    assert len(quantized_layers(load_model(path, quantize="int8"))) == 8  # one scale per row: any width


# -- GGUF -----------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "quantize"), [(Q.Q4_0, "int4"), (Q.Q4_1, "int4"), (Q.Q4_K, "int4"),
                                                (Q.Q8_0, "int8")], ids=lambda v: getattr(v, "name", v))
def test_gguf_blocks_load_exactly_and_are_never_expanded(
    kind: Q, quantize: str, tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A llama-architecture file (Q/K rows interleaved): each quantized layer holds exactly
    the weights the dequantizing load gives, and no linear weight went through dequantize()."""
    file = write_gguf(tiny_model_factory("llama", **WIDE), tmp_path / "model.gguf", types=lambda name: kind)
    full = load_model(file)
    expanded: list[tuple[int, ...]] = []
    real = engine.gguf_file.dequantize

    def recording(raw, ggml_type, shape, dtype):  # noqa: ANN001, ANN202 - the wrapped function's signature
        expanded.append(shape)
        return real(raw, ggml_type, shape, dtype)

    monkeypatch.setattr(engine.gguf_file, "dequantize", recording)
    model = load_model(file, quantize=quantize)
    assert expanded and all(len(shape) == 1 or shape[0] == full.config.vocab_size for shape in expanded)
    layers = quantized_layers(model)
    assert len(layers) == 4 * full.config.num_layers
    full_modules = dict(full.named_modules())
    for name, layer in layers.items():
        assert layer.group_size == 32
        assert torch.equal(layer.dequantized_weight(torch.float32), full_modules[name].weight), name
    ids = list(range(7, 50))
    torch.testing.assert_close(all_logits(model, ids), all_logits(full, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("kind", "quantize"), [(Q.Q8_0, "int4"), (Q.F16, "int8"), (Q.Q5_K, "int4")],
                         ids=lambda v: getattr(v, "name", v))
def test_gguf_types_without_an_exact_mapping_are_requantized_per_tensor(
    kind: Q, quantize: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
):
    file = write_gguf(tiny_model_factory("qwen3", **WIDE), tmp_path / "model.gguf", types=lambda name: kind)
    full, model = load_model(file), load_model(file, quantize=quantize)
    full_modules = dict(full.named_modules())
    for name, layer in quantized_layers(model).items():
        weight = full_modules[name].weight
        expected = quantize_weight(weight, quantize, 32).dequantize()
        # requantized from the fp32 expansion with groups of 32
        assert torch.equal(layer.dequantized_weight(torch.float32), expected), name
