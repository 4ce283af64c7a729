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

What a graph holds is DecodeGraphs.region(bucket): the model over the first
`bucket` rows of the static buffers. A graph replays fixed kernels over fixed
memory, so the region must read nothing back to the host and every shape in it
must follow from the bucket alone; tests/test_cuda_graphs.py runs each bucket's
region on the fake CUDA device (tests/fake_gpu.py) at full model size and checks
both. Not graphed: dynamic RoPE (its tables are rebuilt on the host when a
context outgrows them), and MoE in bf16 on devices where torch's grouped GEMM
has no kernel of its own (compute capability other than 9.x and 10.x: its
fallback reads the expert offsets back, docs/gpu.md).

How a region is captured is a parameter (`capture`): CUDA graphs on a CUDA
device, `eager` elsewhere (the same padded buffers, the region run at each
replay: how the tests check the padding on a CPU and run the regions on fake
tensors, and the fallback where graphs are unavailable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from engine.batch import ForwardBatch
from engine.model import CausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, *range(16, 257, 16))
GROUPED_GEMM_CAPABILITIES = (9, 10)  # compute capability majors where torch._grouped_mm reads nothing back

Region = Callable[[], torch.Tensor]
Capture = Callable[[Region], Region]  # a region -> what replays it


def graphable(model: CausalLM, capability: tuple[int, int] | None) -> bool:
    """Whether every operation of the model's decode forward can be replayed from a graph on a
    device of this compute capability (None: not a CUDA device, where nothing is captured)."""
    config = model.config
    ropes = [config.rope] + ([config.sliding_rope] if config.sliding_rope is not None else [])
    if any(rope.rope_type == "dynamic" for rope in ropes):
        return False
    grouped_gemm = config.num_experts > 0 and model.embed_tokens.weight.dtype == torch.bfloat16
    return not grouped_gemm or capability is None or capability[0] in GROUPED_GEMM_CAPABILITIES


def eager(region: Region) -> Region:
    """No capture: each replay runs the region."""
    return region


class CudaGraphCapture:
    """Captures regions into CUDA graphs; every graph shares one memory pool, as they never run at once."""

    def __init__(self) -> None:
        self._pool: torch.cuda._POOL_HANDLE | None = None  # after the first capture

    def __call__(self, region: Region) -> Region:
        """Warm up on a side stream (kernels compiled, allocator primed), then capture. DecodeGraphs
        fills the buffers with the step's real rows first, so the warm-up writes exactly the K/V
        that step writes, and nothing else."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            region()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = region()
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class DecodeGraphs:
    """Decode forwards over static buffers, replayed per batch-size bucket."""

    def __init__(self, model: CausalLM, max_batch: int, max_pages: int, device: torch.device,
                 capture: Capture | None = None, buckets: Iterable[int] = DEFAULT_BUCKETS) -> None:
        self.model = model
        self.capture = capture or (CudaGraphCapture() if device.type == "cuda" else eager)
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
        self._replays: dict[int, Region] = {}

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
        replay = self._replays.get(bucket)
        if replay is None:
            replay = self._replays[bucket] = self.capture(self.region(bucket))
        return replay()[:rows]

    def region(self, bucket: int) -> Region:
        """What the bucket's graph holds: the model over the first `bucket` rows of the static buffers."""
        batch = self._static_batch(bucket)
        return lambda: self.model(batch)

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
