"""Host syncs per decode step, counted and budgeted (docs/gpu.md): one decode step of the CUDA
path, on fake tensors (tests/fake_gpu.py), records every read of device data by the host. The
budget: one read-back of the step's sampled tokens, plus at most one for speculation, plus what a
feature the job asked for must bring back (its log-probabilities); nothing per layer, nothing
per job. A change that adds a read fails here with the line that asks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import Constraint, Generator, Job, SamplerSettings, Stage
from engine.cache import KVCache
from engine.engine_config import EngineConfig
from engine.moe import SparseMoE
from engine.named_configs import NAMED_CONFIGS
from engine.tokenizer import Tokenizer
from genq_dev.tiny_model import write_tokenizer_files
from tests.fake_gpu import fake_gpu, fake_model

TOKENS = "engine/step_batch.py run"  # the step's sampled tokens, read back once
# with log-probabilities wanted, the tokens come back packed with them instead, still one read
TOKENS_AND_LOGPROBS = "engine/batch_sampler.py read_back"
DRAFTS = "engine/spec_decode.py _with_model"  # a draft model's proposals, all positions in one read

# scenario -> the reads of one decode step (where -> how many), the same at 1, 64 and 256 jobs.
BUDGET: dict[str, dict[str, int]] = {
    "greedy": {TOKENS: 1},
    "sampled": {TOKENS: 1},
    "logprobs": {TOKENS_AND_LOGPROBS: 1},
    "constrained": {TOKENS: 1},  # the grammar's masks are made on the host and only sent
    "n-gram": {TOKENS: 1},  # n-gram drafts come from the host's token lists; verify rows are sampled with the rest
    "draft model": {DRAFTS: 1, TOKENS: 1},  # was one read per draft position (4)
    "mixtral": {TOKENS: 1},  # MoE routing stays on the device (engine/moe.py)
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tokenizer"), 512, "llama"))


def job(scenario: str, i: int, token: int) -> Job:
    prompt = [token] * 12
    options: dict[str, object] = {}
    if scenario == "sampled":
        options = {"seed": i, "gen_settings": SamplerSettings(temperature=0.8, top_k=40, top_p=0.9)}
    elif scenario == "logprobs":
        options = {"top_logprobs": 2}
    elif scenario == "constrained":
        options = {"constraint": Constraint.regex("a+")}
    return Job(prompt, 64, stop_conditions=[], identifier=i, **options)


def decode_step_reads(scenario: str, jobs: int, tokenizer: Tokenizer) -> Counter[str]:
    """The host reads of one decode step with `jobs` jobs decoding (two layers of the model: a
    per-layer read would show as two)."""
    (token,) = tokenizer.encode("a", add_special_tokens=False)
    name = "mixtral-8x7b" if scenario == "mixtral" else "llama-3.1-8b"
    config = EngineConfig().with_options(max_batch_size=jobs, max_chunk_size=16 * jobs, cuda_graphs=False,
                                         use_ngram_draft=scenario == "n-gram", max_speculative_batch=jobs)
    with fake_gpu(token) as gpu:
        model = fake_model(NAMED_CONFIGS[name], torch.bfloat16, num_layers=2)
        cache = KVCache.allocate(model.config, 8 * jobs, 16, torch.bfloat16, torch.device("cuda"))
        draft = draft_cache = None
        if scenario == "draft model":  # the main model's first layer
            draft = fake_model(NAMED_CONFIGS[name], torch.bfloat16, num_layers=1)
            draft_cache = KVCache.allocate(draft.config, 8 * jobs, 16, torch.bfloat16, torch.device("cuda"))
        generator = Generator(model, cache, tokenizer, config, draft, draft_cache)
        generator.enqueue([job(scenario, i, token) for i in range(jobs)])
        streaming: set[object] = set()
        while len(streaming) < jobs:  # until every job has its first token: the next step decodes only
            streaming |= {r.identifier for r in generator.iterate() if r.stage == Stage.STREAMING}
        gpu.reset()
        generator.iterate()
        assert generator.num_active_jobs() == jobs
        assert (generator.counters.drafted_tokens > 0) == (scenario in ("n-gram", "draft model"))
        return Counter(read.where for read in gpu.reset())


@pytest.mark.parametrize("jobs", [1, 64, 256])
@pytest.mark.parametrize("scenario", list(BUDGET))
def test_a_decode_step_reads_from_the_device_only_what_the_budget_allows(scenario: str, jobs: int,
                                                                           tokenizer: Tokenizer):
    assert decode_step_reads(scenario, jobs, tokenizer) == Counter(BUDGET[scenario])


def test_the_sync_free_moe_formulations_give_the_reference_outputs():
    """What the CUDA path runs instead of the per-layer read (the grouped GEMM in bf16, every expert
    weighted for other dtypes), run on the CPU against the expert loop, the path the transformers
    parity tests cover (test_engine_vs_transformers.py -k mixtral)."""
    from engine.config import ModelConfig

    config = ModelConfig.from_dict({**NAMED_CONFIGS["mixtral-8x7b"], "hidden_size": 64, "intermediate_size": 96,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1})
    torch.manual_seed(0)
    moe = SparseMoE(config).to(torch.bfloat16)
    for weight in (moe.experts.gate_up_proj, moe.experts.down_proj):
        torch.nn.init.normal_(weight, std=0.1)
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    weights, experts = moe.route(x)
    order = torch.argsort(experts.reshape(-1), stable=True)
    counts = torch.bincount(experts.reshape(-1), minlength=config.num_experts)
    rows = x[order // moe.top_k]
    torch.testing.assert_close(moe.experts.grouped(rows, counts), moe.experts.looped(rows, counts), rtol=0, atol=0)
    torch.testing.assert_close(moe.every_expert(x, weights, experts), moe(x), rtol=0.02, atol=0.02)
