"""The CUDA path, run on the CPU: real models at real size on fake tensors (tests/fake_gpu.py:
nothing is allocated, no kernel runs), built with device="cuda" in bf16 and fp16, over fp16 / q8 / q4
caches sized for an 80 GB card; warmup and generator steps with prefill and decode, greedy and
sampled rows, a constraint, log-probabilities, n-gram speculation and a draft model. A tensor left
on the host beside a device one, or an op a dtype does not support, raises as it would on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine import Constraint, Generator, Job, SamplerSettings
from engine.cache import KVCache
from engine.device_info import DeviceInfo
from engine.engine_config import EngineConfig
from engine.loading import default_cache_bytes
from engine.memory_plan import cuda_cache_bytes
from engine.model import CausalLM
from engine.named_configs import NAMED_CONFIGS
from engine.outputs import FinishReason
from engine.tokenizer import Tokenizer
from genq_dev.tiny_model import write_tokenizer_files
from tests.engine_runs import run
from tests.fake_gpu import fake_gpu, fake_model

GiB = 2**30
H100 = DeviceInfo("NVIDIA H100 80GB HBM3 (dry run)", 80 * GiB, 79 * GiB, (9, 0))
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A small real tokenizer: the models' vocabularies are larger, ids past its own are never read back."""
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tokenizer"), 512, "llama"))


def letter(tokenizer: Tokenizer) -> int:
    """The token the fake device reads back for every sampled id: "a", so a constraint to a+ holds."""
    (token,) = tokenizer.encode("a", add_special_tokens=False)
    return token


def sized_cache(model: CausalLM, config: EngineConfig, device: DeviceInfo) -> KVCache:
    """The cache the worker would allocate on `device` (engine/loading.py's sizing, through the seam)."""
    memory = default_cache_bytes(CUDA, model, config, device)
    per_token = KVCache.bytes_per_token(model.config, model.embed_tokens.weight.dtype, config.cache.cache_dtype)
    pages = memory // per_token // config.cache.page_size
    return KVCache.allocate(model.config, pages, config.cache.page_size, model.embed_tokens.weight.dtype, CUDA,
                            config.cache.cache_dtype)


# Each model in each dtype once, the cache formats taken in turn.
BUILDS = [(name, dtype, cache) for i, (name, dtype) in enumerate(
    (name, dtype) for name in NAMED_CONFIGS for dtype in (torch.bfloat16, torch.float16))
    for cache in [("auto", "q8", "q4")[i % 3]]]


@pytest.mark.parametrize(("name", "dtype", "cache_dtype"), BUILDS)
def test_a_full_size_model_builds_on_the_gpu_and_warms_up(name: str, dtype: torch.dtype, cache_dtype: str,
                                                         tokenizer: Tokenizer):
    config = EngineConfig().with_options(cache_dtype=cache_dtype, max_batch_size=64, cuda_graphs=False)
    with fake_gpu(letter(tokenizer)) as gpu:
        model = fake_model(NAMED_CONFIGS[name], dtype)
        cache = sized_cache(model, config, H100)
        generator = Generator(model, cache, tokenizer, config)
        generator.warmup()
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", dtype)}
    assert cache.k.device.type == "cuda" and cache.cache_dtype == (cache_dtype if cache_dtype != "auto" else "auto")
    assert [r.op for r in gpu.reads].count("tolist") >= 2  # the warmup's steps read their tokens back
    # the cache takes what the memory plan gives it on an 80 GB card: gigabytes, not a CPU default
    planned = cuda_cache_bytes(model.config, dtype.itemsize, H100.total_memory, H100.free_memory, config)
    per_token = KVCache.bytes_per_token(model.config, dtype, cache_dtype)
    assert cache.num_pages == planned // per_token // config.cache.page_size and planned > 10 * GiB


def mixed_jobs(token: int) -> list[Job]:
    """Prefill chunks beside decodes, greedy and sampled rows, log-probabilities, a constrained job;
    prompts that repeat, so n-gram drafts are proposed."""
    prompt = [token] * 40
    return [
        Job(prompt, 3, stop_conditions=[], identifier="greedy"),
        Job(prompt * 3, 3, stop_conditions=[], identifier="long prompt, chunked"),
        Job(prompt[:9], 3, stop_conditions=[], identifier="sampled", seed=1,
            gen_settings=SamplerSettings(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1)),
        Job(prompt[:5], 3, stop_conditions=[], identifier="logprobs", top_logprobs=3, prompt_logprobs=2),
        Job(prompt[:7], 3, stop_conditions=[], identifier="constrained", constraint=Constraint.regex("a+")),
    ]


@pytest.mark.parametrize("speculation", ["draft model", "n-gram"])
def test_mixed_steps_with_a_constraint_logprobs_and_speculation(speculation: str, tokenizer: Tokenizer):
    """Llama-3.1-8B at full size in bf16 over a q8 cache; the draft model is its first two layers."""
    token = letter(tokenizer)
    llama = NAMED_CONFIGS["llama-3.1-8b"]
    config = EngineConfig().with_options(cache_dtype="q8", max_batch_size=16, max_chunk_size=64, page_size=16,
                                         cuda_graphs=False, use_ngram_draft=speculation == "n-gram")
    with fake_gpu(token) as gpu:
        model = fake_model(llama, torch.bfloat16)
        cache = KVCache.allocate(model.config, 64, 16, torch.bfloat16, CUDA, "q8")
        draft = draft_cache = None
        if speculation == "draft model":
            draft = fake_model(llama, torch.bfloat16, num_layers=2)
            draft_cache = KVCache.allocate(draft.config, 64, 16, torch.bfloat16, CUDA, "q8")
        generator = Generator(model, cache, tokenizer, config, draft, draft_cache)
        generator.warmup()
        jobs = mixed_jobs(token)
        finals = run(generator, jobs)
    assert {name: (f.eos_reason, f.completion_ids) for name, f in finals.items()} == {
        j.identifier: (FinishReason.MAX_NEW_TOKENS, [token] * 3) for j in jobs}
    assert [len(entry.top) for entry in finals["logprobs"].completion_logprobs or []] == [3, 3, 3]
    assert generator.counters.drafted_tokens > 0
    assert gpu.reads  # the steps read their tokens back through the fake device
