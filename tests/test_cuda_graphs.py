"""The CUDA-graph decode path. Its static buffers and bucket padding, run eagerly
on the CPU (engine/cuda_graphs.py `eager`): padded to its bucket, a decode batch
gives the logits and writes the K/V of the plain forward, and a generator using
the path gives the same results. What each bucket's graph would hold (its
region) runs on the fake CUDA device (tests/fake_gpu.py) at full model size:
no host reads, every shape from the bucket alone. Capture and replay
themselves need a GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine import Generator, Job
from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs, Region, eager, graphable
from engine.model_runner import BatchRow
from engine.named_configs import NAMED_CONFIGS
from engine.weights import load_model
from tests.fake_gpu import FakeGPU, HostRead, fake_gpu, fake_model
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
    graphs = DecodeGraphs(generator.model, 16, runner.builder._tables.shape[1], torch.device("cpu"), capture=eager)
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
    prefill = generator.runner.builder.build([BatchRow.scheduled(item) for item in schedule.scheduled])
    graphs = DecodeGraphs(generator.model, 4, 4, torch.device("cpu"), capture=eager)
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


def test_moe_is_graphed_where_its_dispatch_reads_nothing_back(hf_model_factory: Callable[..., Path],
                                                             llama_dir: Path):
    """bf16 MoE runs torch's grouped GEMM, which reads its offsets back except on compute
    capability 9.x and 10.x; other dtypes run every expert, which reads nothing back anywhere."""
    moe = load_model(hf_model_factory("MixtralConfig", num_local_experts=4, num_experts_per_tok=2))
    assert all(graphable(moe, capability) for capability in ((8, 0), (9, 0), (10, 0), None))
    moe_bf16 = moe.to(torch.bfloat16)
    assert [graphable(moe_bf16, c) for c in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0), None)] == [
        False, False, True, True, False, True]
    assert graphable(load_model(llama_dir), (8, 0))


TensorMeta = tuple[tuple[int, ...], str, torch.dtype]  # shape, device type, dtype
Op = tuple[str, tuple[TensorMeta, ...], tuple[TensorMeta, ...]]  # name, inputs, outputs


class OpLog(TorchDispatchMode):
    """Every op run inside: its name and the (shape, device, dtype) of each tensor it takes and gives."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), _tensors((args, kwargs)), _tensors(out)))
        return out


def _tensors(value: object) -> tuple[TensorMeta, ...]:
    return tuple((tuple(t.shape), t.device.type, t.dtype) for t in tree_flatten(value)[0]
                 if isinstance(t, torch.Tensor))


@dataclass
class RecordingCapture:
    """A capture for the fake device (a CUDA graph cannot be made there): each bucket's region is
    "captured" once and runs at each replay, its ops and host reads recorded per replay."""

    gpu: FakeGPU
    captured: int = 0
    replays: list[tuple[list[Op], list[HostRead]]] = field(default_factory=list)

    def __call__(self, region: Region) -> Region:
        self.captured += 1

        def replay() -> torch.Tensor:
            outside = self.gpu.reset()
            with OpLog() as log:
                output = region()
            self.replays.append((log.ops, self.gpu.reset()))
            self.gpu.reads = outside
            return output

        return replay


def decode_batch(rows: int, context: int, page_size: int) -> ForwardBatch:
    """A decode batch of `rows` one-token rows with contexts of about `context` tokens, sent to the device."""
    lens = context + np.arange(rows) % 7
    width = -(-int(lens.max()) // page_size)
    tables = 1 + np.arange(rows * width).reshape(rows, width)
    positions = lens - 1
    slots = tables[np.arange(rows), positions // page_size] * page_size + positions % page_size

    def cuda(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(values).to("cuda", dtype)

    return ForwardBatch(cuda(np.full(rows, 5), torch.long), cuda(positions, torch.long),
                        cuda(np.arange(rows + 1), torch.int32), cuda(lens, torch.int32),
                        cuda(tables, torch.int32), cuda(slots, torch.long), cuda(np.arange(rows), torch.long))


@pytest.mark.parametrize(("name", "dtype"), [("llama-3.1-8b", torch.bfloat16), ("mixtral-8x7b", torch.bfloat16),
                                             ("mixtral-8x7b", torch.float16)])
def test_each_buckets_graph_reads_nothing_back_and_its_shapes_follow_from_the_bucket(name: str,
                                                                                      dtype: torch.dtype):
    """Full-size layers (two of them) on the fake device: each bucket's region runs for two batches
    padded to it, one full and one of the fewest rows the bucket takes, with short and long
    contexts; both run the same ops on the same shapes, all on the device, and read nothing back."""
    page_size, max_pages = 16, 64
    with fake_gpu() as gpu:
        model = fake_model(NAMED_CONFIGS[name], dtype, num_layers=2)
        model.bind_cache(KVCache.allocate(model.config, 4096, page_size, dtype, torch.device("cuda")))
        capture = RecordingCapture(gpu)
        graphs = DecodeGraphs(model, 256, max_pages, torch.device("cuda"), capture=capture)
        assert graphable(model, (9, 0)) and graphs.buckets == list(DEFAULT_BUCKETS)
        smaller = 0
        for bucket in graphs.buckets:
            for rows, context in ((bucket, 20), (smaller + 1, 700)):
                logits = graphs.run(decode_batch(rows, context, page_size))
                assert logits.shape == (rows, model.config.vocab_size)
            smaller = bucket
    assert capture.captured == len(graphs.buckets)  # once per bucket, replayed after
    assert graphs.runs == {bucket: 2 for bucket in graphs.buckets}
    for i, bucket in enumerate(graphs.buckets):
        (full, full_reads), (fewest, fewest_reads) = capture.replays[2 * i : 2 * i + 2]
        assert full_reads == fewest_reads == [], bucket
        assert full == fewest, bucket
        assert {device for _, inputs, _ in full for _, device, _ in inputs} == {"cuda"}, bucket
        assert full[-1][2][0][0] == (bucket, model.config.vocab_size)  # the logits of every row of the bucket
