"""`genq plan` and engine/memory_plan.py: figures checked against arithmetic written out here from
the configs (and the models' published parameter counts), and against the real model and cache
code built on the meta device (nothing allocated)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from engine.cache import KVCache
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.memory_plan import PlanError, cuda_cache_bytes, kv_bytes_per_token, parameter_count, weight_bytes
from engine.model import CausalLM
from engine.named_configs import NAMED_CONFIGS
from engine.quantized_linear import QuantizedLinear, quantize_linears
from tests.gguf_files import gguf_name, write_gguf
from worker.cli import build_parser
from worker.plan import build_plan
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
GB = 10**9


def plan(*argv: str) -> dict[str, Any]:
    return build_plan(build_parser().parse_args(["plan", *argv]))


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.cli", "plan", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def expected_pages(gpu: int, weights: int, reserve: int, per_token: int, page_size: int = 16) -> int:
    return (int(gpu * 0.9) - weights - reserve) // (per_token * page_size)


@pytest.mark.parametrize("cache_dtype", ["auto", "q4"])
def test_llama_3_1_8b_on_80gb_in_bf16(cache_dtype: str):
    c = NAMED_CONFIGS["llama-3.1-8b"]
    hidden, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    per_layer = (hidden * heads * head_dim * 2  # q, o
                 + hidden * kv_heads * head_dim * 2  # k, v
                 + 3 * hidden * inter  # gate, up, down
                 + 2 * hidden)  # two norms
    params = layers * per_layer + 2 * vocab * hidden + hidden  # untied embeddings and lm_head, final norm
    assert params == 8_030_261_248  # Meta's published count for Llama-3.1-8B
    if cache_dtype == "auto":  # 2 bytes a value, K and V
        per_token = layers * kv_heads * head_dim * 2 * 2
    else:  # q4: half a byte a value + an fp16 scale and minimum per 16 values, K and V
        per_token = layers * kv_heads * (head_dim // 2 + (head_dim // 16) * 2 * 2) * 2
    activations = 2048 * 2 * (2 * hidden + max((heads + 2 * kv_heads) * head_dim + heads * head_dim, 3 * inter))
    logits = 256 * vocab * (2 + 3 * 4 + 1 + 2 * 4)
    pages = expected_pages(80 * GB, params * 2, activations + logits, per_token)

    got = plan("llama-3.1-8b", "--gpu-memory", "80GB", "--dtype", "bfloat16", "--cache-dtype", cache_dtype)
    assert got["parameters"] == params
    assert got["weights"]["bfloat16"] == got["weights"]["float16"] == got["planned_weight_bytes"] == 2 * params
    assert got["reserve"]["activation_bytes"] == activations and got["reserve"]["logits_bytes"] == logits
    assert got["plan"]["bytes_per_token"] == per_token and got["plan"]["page_bytes"] == 16 * per_token
    assert got["plan"]["num_pages"] == pages and got["plan"]["cache_tokens"] == 16 * pages
    assert got["plan"]["jobs_fit"] == pages // (4096 // 16)
    assert got["plan"]["jobs_fit"] == (102 if cache_dtype == "auto" else 273)


def test_a_gqa_model_with_qkv_biases():
    c = NAMED_CONFIGS["qwen2.5-7b"]
    hidden, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    assert layers * per_layer + 2 * vocab * hidden + hidden == 7_615_616_512  # Qwen's published count
    got = plan("qwen2.5-7b", "--gpu-memory", "80GB")
    assert got["parameters"] == 7_615_616_512
    assert got["plan"]["bytes_per_token"] == layers * kv_heads * head_dim * 2 * 2  # 4 KV heads, not 28


def test_gemma_2_counts_its_sliding_window_layers_in_full():
    """Gemma 2's 21 sliding-window layers share page tables with its 21 global ones, so the cache
    keeps every token of every layer: all 42 layers count per token."""
    c = NAMED_CONFIGS["gemma-2-9b"]
    hidden, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 4 * hidden
    params = layers * per_layer + vocab * hidden + hidden  # tied embeddings, four norms a layer
    assert params == 9_241_705_984  # Google's published count
    got = plan("gemma-2-9b", "--gpu-memory", "80GB", "--dtype", "bfloat16")
    assert got["parameters"] == params and got["sliding_window_layers"] == layers // 2
    assert got["plan"]["bytes_per_token"] == layers * kv_heads * head_dim * 2 * 2


def test_mixtral_experts_stay_unquantized():
    c = NAMED_CONFIGS["mixtral-8x7b"]
    hidden, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads, experts = c["num_attention_heads"], c["num_key_value_heads"], c["num_local_experts"]
    head_dim = hidden // heads
    attention = [(heads * head_dim + 2 * kv_heads * head_dim, hidden), (hidden, heads * head_dim)]  # (out, in)
    other = experts * 3 * hidden * inter + hidden * experts + 2 * hidden  # experts, router, norms
    params = layers * (sum(n * k for n, k in attention) + other) + 2 * vocab * hidden + hidden
    assert params == 46_702_792_704  # Mistral's published count
    int4_attention = sum(n * k // 2 + 2 * n * (k // 32) * 4 for n, k in attention)
    int4 = layers * (int4_attention + 2 * other) + 2 * (2 * vocab * hidden + hidden)
    got = plan("mixtral-8x7b", "--gpu-memory", "141GB", "--quantize", "int4")
    assert got["parameters"] == params and got["experts"] == experts
    assert got["planned_weight_bytes"] == got["weights"]["int4 (rest bfloat16)"] == int4


TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100}
FAMILIES = {
    "llama": NAMED_CONFIGS["llama-3.1-8b"],
    "qwen2": NAMED_CONFIGS["qwen2.5-7b"],
    "gemma2": NAMED_CONFIGS["gemma-2-9b"],
    "qwen3": {"architectures": ["Qwen3ForCausalLM"]},
    "mixtral": NAMED_CONFIGS["mixtral-8x7b"],
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "decoder_sparse_step": 2, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_bytes_equal_the_real_model_built_on_meta(family: str):
    config = ModelConfig.from_dict({**FAMILIES[family], **TINY})
    with torch.device("meta"):
        model = CausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert parameter_count(config) == params
    assert weight_bytes(config, 2) == params * 2
    for quantize in ("int8", "int4"):
        with torch.device("meta"):
            quantized = CausalLM(config).to(torch.bfloat16)
        quantize_linears(quantized, quantize)
        layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
        rest = sum(p.numel() * p.element_size() for p in quantized.parameters())  # biases included
        assert weight_bytes(config, 2, quantize) == sum(m.weight_bytes() for m in layers) + rest


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "q8", "q4", "k8v4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kv_bytes_per_token_equal_the_allocated_cache(cache_dtype: str, head_dim: int):
    config = ModelConfig.from_dict({**NAMED_CONFIGS["llama-3.1-8b"], **TINY, "head_dim": head_dim})
    cache = KVCache.allocate(config, 3, 16, torch.bfloat16, "meta", cache_dtype)
    tensors = [cache.k, cache.v, cache.k_scales, cache.v_scales]
    allocated = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    assert kv_bytes_per_token(config, cache_dtype, 2) * 3 * 16 == allocated
    assert kv_bytes_per_token(config, cache_dtype, 2) == KVCache.bytes_per_token(config, torch.bfloat16, cache_dtype)


def test_a_gguf_plan_reads_the_files_tensor_sizes(tiny_model_factory: Callable[..., Path], tmp_path: Path):
    source = tiny_model_factory("llama", rope_scaling=None, hidden_size=256, intermediate_size=512, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2)

    def kind(name: str) -> Q:
        return Q.Q4_0 if "ffn" in name else Q.Q8_0 if "attn" in name else Q.F16

    file = write_gguf(source, tmp_path / "model.gguf", types=kind)
    tied = json.loads((source / "config.json").read_text()).get("tie_word_embeddings")
    expected = 0
    for name, values in load_file(str(source / "model.safetensors")).items():
        if tied and name == "lm_head.weight":
            continue
        ggml = kind(gguf_name(name)) if values.ndim == 2 else Q.F32
        block_values, block_bytes = GGML_QUANT_SIZES[ggml]
        expected += values.size // block_values * block_bytes
    result = cli(str(file), "--gpu-memory", "1GiB", "--json")
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert sum(got["gguf_tensor_bytes"].values()) == expected
    assert set(got["gguf_tensor_bytes"]) == {"Q4_0", "Q8_0", "F16", "F32"}
    assert got["layers"] == json.loads((source / "config.json").read_text())["num_hidden_layers"]


def test_the_command_prints_the_jobs_that_fit_quickly():
    started = time.monotonic()
    result = cli("llama-3.1-8b", "--gpu-memory", "80GB", "--job-tokens", "4096")
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert "jobs that fit: 102 jobs of 4096 tokens" in result.stdout
    assert elapsed < 5, f"genq plan took {elapsed:.1f} s"


def test_bad_input_names_the_option_and_the_limit():
    unknown = cli("llama-9000", "--gpu-memory", "80GB")
    assert unknown.returncode == 2 and "llama-9000" in unknown.stderr and "llama-3.1-8b" in unknown.stderr
    not_a_size = cli("llama-3.1-8b", "--gpu-memory", "80")
    assert not_a_size.returncode == 2 and "--gpu-memory '80' is not a size" in not_a_size.stderr
    small = cli("llama-3.1-8b", "--gpu-memory", "16GB")
    params = 8_030_261_248
    reserve = plan("llama-3.1-8b", "--gpu-memory", "80GB")["reserve"]["total_bytes"]
    needed = (2 * params + reserve + 256 * 16 * 131_072) / 0.9 / 2**30
    assert small.returncode == 2
    assert "--gpu-memory 14.90 GiB is too small" in small.stderr and f"need at least {needed:.2f} GiB" in small.stderr


def test_the_cuda_worker_budget_is_the_planners():
    """What engine/loading.py gives the cache on CUDA: utilization of the total, less what is in use
    and the step reserve, whose limits come from the worker's settings."""
    config = ModelConfig.from_dict(NAMED_CONFIGS["llama-3.1-8b"])
    engine = Settings(model="m", gpu_memory_utilization=0.8, max_batch_size=64, max_chunk_size=1024).engine_config()
    assert engine.cache.gpu_memory_utilization == 0.8
    total, free = 80 * 2**30, 60 * 2**30
    reserve = 1024 * 2 * (2 * 4096 + 3 * 14336) + 64 * 128256 * (2 + 21)
    assert cuda_cache_bytes(config, 2, total, free, engine) == int(total * 0.8) - (total - free) - reserve
    with pytest.raises(PlanError, match=r"gpu_memory_utilization=0\.2 of 80\.00 GiB leaves no KV cache"):
        cuda_cache_bytes(config, 2, total, free, EngineConfig().with_options(gpu_memory_utilization=0.2))
