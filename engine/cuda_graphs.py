"""CUDA graphs for decode steps: the forward of a batch of one-token rows,
captured once per batch-size bucket and replayed.

At a large batch a decode step launches a few hundred small kernels; on a GPU
their launch cost (tens of microseconds each from Python) can exceed the work.
A CUDA graph replays the whole forward with one launch. As in vLLM and
nano-vllm, a graph is captured per bucket of batch sizes (1, 2, 4, 8, then
every 16) over static input buffers; a step with n rows runs the smallest
bucket >= n.

Padding rows repeat the batch's last row (same token, position, page table
and slot): they compute exactly the K/V the real row writes to the same slot,
so no scratch page is needed and the cache is never touched elsewhere; their
logits are dropped. The buffers hold the whole page-table width, since the
paged-attention kernel stops at each row's context length.

Only what a graph can replay is captured: the Triton kernels (no host syncs),
dense models (the MoE dispatch reads segment sizes on the host), RoPE tables
that need no host work. With `capture=False` the same padded buffers run
eagerly: that is how the tests check the padding on a CPU, and the fallback
where graphs are unavailable.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.batch import ForwardBatch
from engine.model import CausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, *range(16, 257, 16))


def graphable(model: CausalLM) -> bool:
    """Whether every operation of the model's decode forward can be replayed from a graph."""
    config = model.config
    ropes = [config.rope] + ([config.sliding_rope] if config.sliding_rope is not None else [])
    return config.num_experts == 0 and all(rope.rope_type != "dynamic" for rope in ropes)


class DecodeGraphs:
    """Decode forwards over static buffers, replayed per batch-size bucket."""

    def __init__(self, model: CausalLM, max_batch: int, max_pages: int, device: torch.device,
                 capture: bool | None = None, buckets: Iterable[int] = DEFAULT_BUCKETS) -> None:
        self.model = model
        self.capture = device.type == "cuda" if capture is None else capture
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.context_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(size, max_pages, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(size, dtype=torch.long, device=device)
        self.cu_seqlens = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(size, dtype=torch.long, device=device)
        self.runs: dict[int, int] = {}  # bucket -> decode steps run through it
        self.padded_rows = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: object | None = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def supports(self, batch: ForwardBatch) -> bool:
        """A decode-only batch (one token per row, every row's logits, no embeddings) that fits."""
        rows = batch.context_lens.shape[0]
        return (batch.embeddings is None and batch.num_tokens == rows == batch.logits_indices.shape[0]
                and rows <= self.max_batch and batch.page_table.shape[1] <= self.page_table.shape[1])

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's logits, through the graph of its bucket (captured on first use)."""
        rows = batch.num_tokens
        bucket = self.bucket(rows)
        self.runs[bucket] = self.runs.get(bucket, 0) + 1
        self.padded_rows += bucket - rows
        self._fill(batch, bucket)
        if not self.capture:
            return self.model(self._static_batch(bucket))[:rows]
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._capture(bucket)
        graph.replay()
        return self._outputs[bucket][:rows]

    def _fill(self, batch: ForwardBatch, bucket: int) -> None:
        rows = batch.num_tokens
        source = torch.arange(bucket, device=self.input_ids.device).clamp_(max=rows - 1)
        width = batch.page_table.shape[1]
        self.input_ids[:bucket] = batch.input_ids[source]
        self.positions[:bucket] = batch.positions[source]
        self.context_lens[:bucket] = batch.context_lens[source]
        self.slot_mapping[:bucket] = batch.slot_mapping[source]
        self.page_table[:bucket, :width] = batch.page_table[source]

    def _static_batch(self, bucket: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            cu_seqlens_q=self.cu_seqlens[: bucket + 1],
            context_lens=self.context_lens[:bucket],
            page_table=self.page_table[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            logits_indices=self.logits_indices[:bucket],
        )

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (kernels compiled, allocator primed), then capture;
        every bucket shares one memory pool, as the graphs never run at once. The
        buffers already hold the step's real rows (run() fills them first), so the
        warm-up writes exactly the K/V that step writes, and nothing else."""
        batch = self._static_batch(bucket)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[bucket] = self.model(batch)
        self._pool = graph.pool()
        self._graphs[bucket] = graph
        return graph
