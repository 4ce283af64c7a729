"""The CUDA-graph decode path's static buffers and bucket padding, run eagerly
on the CPU (capture=False): padded to its bucket, a decode batch gives the
logits and writes the K/V of the plain forward, and a generator using the
path gives the same results. Capture and replay themselves need a GPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Generator, Job
from engine.cuda_graphs import DecodeGraphs, graphable
from engine.model_runner import BatchRow
from engine.weights import load_model
from tests.test_overlap import finals


def test_buckets_cover_every_batch_size_up_to_the_largest():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = [1, 2, 4, 8, 16, 32, 40]
    assert [graphs.bucket(n) for n in (1, 3, 5, 8, 9, 33, 40)] == [1, 4, 8, 8, 16, 40, 40]


def test_a_padded_decode_batch_gives_the_plain_logits_and_writes_only_its_own_slots(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8, max_batch_size=16)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(5)]  # 5 rows: padded to bucket 8
    for i, prompt in enumerate(prompts):
        generator.enqueue(Job(prompt, 4, stop_conditions=[], identifier=i))
    while not any(r.stage == "streaming" for r in generator.iterate()):
        pass  # every prompt prefilled, each job has its first token
    sequences = sorted(generator._sequences.values(), key=lambda s: s.serial)
    rows = [BatchRow(s, len(s.token_ids) - 1, [s.token_ids[-1]], 1) for s in sequences]
    runner = generator.runner
    batch = runner.builder.build(rows)
    before_k, before_v = generator.cache.k.clone(), generator.cache.v.clone()
    plain = generator.model(batch)
    plain_k, plain_v = generator.cache.k.clone(), generator.cache.v.clone()
    generator.cache.k.copy_(before_k)
    generator.cache.v.copy_(before_v)
    graphs = DecodeGraphs(generator.model, 16, runner.builder._tables.shape[1], torch.device("cpu"), capture=False)
    assert graphs.supports(batch) and graphs.bucket(len(rows)) == 8
    padded = graphs.run(batch)
    assert graphs.runs == {8: 1}
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-5)
    # The same K/V (to matmul rounding: 8 rows are not multiplied exactly as 5), in the same slots only.
    for after, plain_cache, before in ((generator.cache.k, plain_k, before_k), (generator.cache.v, plain_v, before_v)):
        torch.testing.assert_close(after, plain_cache, rtol=0, atol=1e-5)
        written = (after != before).any(dim=-1)
        assert written.any() and torch.equal(written, (plain_cache != before).any(dim=-1))


def test_prefill_batches_are_not_taken(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8, max_batch_size=4)
    generator.enqueue(Job([5, 6, 7], 2, identifier="x"))
    schedule = generator.scheduler.schedule()
    prefill = generator.runner.builder.build([generator._row(item, []) for item in schedule.scheduled])
    graphs = DecodeGraphs(generator.model, 4, 4, torch.device("cpu"), capture=False)
    assert not graphs.supports(prefill)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_generator_on_the_graph_path_gives_the_same_results(family: str, tiny_model_factory: Callable[..., Path]):
    model_dir = tiny_model_factory(family)
    plain = finals(Generator.from_pretrained(model_dir, cache_tokens=2048, page_size=8, max_chunk_size=64))
    graphed_generator = Generator.from_pretrained(model_dir, cache_tokens=2048, page_size=8, max_chunk_size=64,
                                                  cuda_graphs=True)
    graphed = finals(graphed_generator)
    graphs = graphed_generator.runner.graphs
    assert graphs is not None and sum(graphs.runs.values()) > 0 and graphs.padded_rows > 0
    assert graphed == plain


def test_mixture_of_experts_models_are_not_graphed(hf_model_factory: Callable[..., Path], llama_dir: Path):
    moe = load_model(hf_model_factory("MixtralConfig", num_local_experts=4, num_experts_per_tok=2))
    assert not graphable(moe) and graphable(load_model(llama_dir))
