"""The model runner: turns scheduled rows into a ForwardBatch and runs the
model(s) over their paged caches (as nano-vllm's ModelRunner and vLLM's
GPUModelRunner do), so the generator never builds tensors itself.

One batch builder serves the main model's steps (prefill chunks, decodes,
verify rows) and the draft model's autoregressive steps alike: a row is a
sequence, the position of its first token this step, its token ids, and how
many of its last positions need logits (all of them for a prompt whose
log-probabilities are wanted: engine/prompt_logprobs.py).

Persistent state: each running sequence owns a row of a page-table array
that lives across steps. The row is rewritten only when the KV manager
changed the sequence's pages (its page_version moved): a page is added once
per page_size tokens, so a decode step copies no page lists at all. Holes
(pages a sliding window released) are stored as page 0: attention never reads
them. A step made only of one-token rows (pure decode, draft steps) is built
with a handful of vectorised numpy operations over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine import device_info as devices
from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.cuda_graphs import DecodeGraphs, graphable
from engine.lora.batch import LoraBatch
from engine.lora.slots import LoraSlots
from engine.model import CausalLM
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence


@dataclass(slots=True)
class BatchRow:
    """tokens are the ids at positions start .. start + len(tokens) - 1; the
    last num_logits of them need next-token logits. Not frozen, as
    engine/sampling_state.SampleRow."""

    sequence: Sequence
    start: int
    tokens: Seq[int]
    num_logits: int

    @classmethod
    def scheduled(cls, item: ScheduledSequence, draft: Seq[int] = ()) -> BatchRow:
        """The row of a scheduled sequence: its tokens computed this step, then the draft to verify;
        a sampling row wants the logits of its last known token and of each draft token, and a
        prompt being scored (Sequence.scores_prompt) those of every position."""
        sequence = item.sequence
        start = sequence.num_computed
        if item.num_tokens == 1 and not draft:
            return cls(sequence, start, (sequence.token_ids[start],), 1 if item.samples or sequence.scores_prompt
                       else 0)
        tokens = [*sequence.token_ids[start : start + item.num_tokens], *draft]
        if sequence.scores_prompt:
            return cls(sequence, start, tokens, len(tokens))
        return cls(sequence, start, tokens, 1 + len(draft) if item.samples else 0)


class BatchBuilder:
    def __init__(self, page_size: int, max_rows: int, max_pages_per_sequence: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device
        self._tables = np.zeros((max_rows, max_pages_per_sequence), dtype=np.int64)
        self._free = list(range(max_rows - 1, -1, -1))
        # serial -> (table row, page_version written)
        self._rows: dict[int, list[int]] = {}
        self.lora_slots = LoraSlots()  # the adapters' stacked weights: the registry frees a slot on offload
        # The persistent decode rows (vLLM v1's InputBatch): the last decode step's sequences in order,
        # their table rows and page versions, and how many have image embeddings or an adapter. A
        # step whose decode rows are these (less those released, plus newcomers after them) reads
        # their positions and tokens only; joins and departures cost per-row work, steps do not.
        self._decoding: list[Sequence] = []
        self._decode_rows: list[int] = []
        self._decode_versions: list[int] = []
        self._decode_embedded = self._decode_adapted = 0

    def release(self, serial: int) -> None:
        """The sequence left the running batch; its table row is free, and its decode row goes
        (the rows after it move up, in order)."""
        entry = self._rows.pop(serial, None)
        if entry is not None:
            self._free.append(entry[0])
        at = next((i for i in range(len(self._decoding) - 1, -1, -1) if self._decoding[i].serial == serial), None)
        if at is not None:
            sequence = self._decoding.pop(at)
            del self._decode_rows[at], self._decode_versions[at]
            self._count_decode(sequence, -1)

    def build(self, rows: Seq[BatchRow], adapters: bool = True, decoding: Seq[Sequence] = ()) -> ForwardBatch:
        """adapters=False leaves out the rows' LoRA adapters (the draft model runs without them).
        decoding: sequences whose next row is a plain decode (their token at num_computed, its logits
        wanted), placed before `rows`: a decode step passes its rows so, and no BatchRow is built for
        them (vLLM v1's persistent InputBatch: the inputs come from the sequence's own state)."""
        table_rows = self._decode_table(decoding) if decoding else []  # other builds leave the decode rows be
        starts = [sequence.num_computed for sequence in decoding]
        firsts = [sequence.token_ids[start] for sequence, start in zip(decoding, starts)]
        single = not self._decode_embedded  # every row one token, no embeddings: the vectorised decode build
        adapted = self._decode_adapted > 0
        wants = [1] * len(decoding)
        for row in rows:
            sequence = row.sequence
            table_rows.append(self._table_row(sequence))
            if single:
                if len(row.tokens) != 1 or sequence.job.embeddings:
                    single = False
                else:
                    starts.append(row.start)
                    firsts.append(row.tokens[0])
                    wants.append(row.num_logits)
            if sequence.adapter is not None:
                adapted = True
        table = np.asarray(table_rows, dtype=np.int64)
        if single:
            batch = self._single_token_rows(np.asarray(starts, dtype=np.int64), np.asarray(firsts, dtype=np.int64),
                                            np.asarray(wants, dtype=np.int64), table)
        else:
            decoded = (BatchRow(s, start, (token,), 1) for s, start, token in zip(decoding, starts, firsts))
            batch = self._general([*decoded, *rows], table)
        if adapters and adapted:
            every = [*((s.adapter, 1) for s in decoding), *((row.sequence.adapter, len(row.tokens)) for row in rows)]
            batch.lora = LoraBatch.build(every, self.device, self.lora_slots)
        return batch

    def _decode_table(self, decoding: Seq[Sequence]) -> list[int]:
        """The decode rows' table rows, from the persistent rows: kept while the step's decode rows
        start with them in order, newcomers appended, a row rewritten where its pages changed."""
        kept = len(self._decoding)
        if decoding[:kept] != self._decoding:  # another order: start over
            for sequence in self._decoding:
                self._count_decode(sequence, -1)
            self._decoding, self._decode_rows, self._decode_versions, kept = [], [], [], 0
        for sequence in decoding[kept:]:
            self._decoding.append(sequence)
            self._decode_rows.append(self._table_row(sequence))
            self._decode_versions.append(sequence.page_version)
            self._count_decode(sequence, 1)
        rows, versions = list(self._decode_rows), self._decode_versions
        current = [sequence.page_version for sequence in decoding]
        if current != versions:
            for i, sequence in enumerate(decoding):
                if current[i] != versions[i]:
                    rows[i] = self._decode_rows[i] = self._table_row(sequence)
                    versions[i] = current[i]
        return rows

    def _count_decode(self, sequence: Sequence, change: int) -> None:
        if sequence.job.embeddings:
            self._decode_embedded += change
        if sequence.adapter is not None:
            self._decode_adapted += change

    def _table_row(self, sequence: Sequence) -> int:
        entry = self._rows.get(sequence.serial)
        if entry is None:
            if not self._free:
                raise RuntimeError("more running sequences than batch rows")
            entry = self._rows[sequence.serial] = [self._free.pop(), -1]
        if entry[1] != sequence.page_version:
            pages = np.asarray(sequence.pages, dtype=np.int64)
            self._tables[entry[0], : len(pages)] = np.maximum(pages, 0)  # holes -> page 0, never read
            entry[1] = sequence.page_version
        return entry[0]

    def _single_token_rows(self, positions: np.ndarray, input_ids: np.ndarray, wants: np.ndarray,
                           table_rows: np.ndarray) -> ForwardBatch:
        n = len(positions)
        size = self.page_size
        slots = self._tables[table_rows, positions // size] * size + positions % size
        context_lens = positions + 1
        width = -(-int(context_lens.max()) // size)
        logits_indices = np.arange(n) if wants.all() else np.flatnonzero(wants)
        return self._to_device(input_ids, positions, np.arange(n + 1), context_lens,
                               self._tables[table_rows, :width], slots, logits_indices, None)

    def _general(self, rows: Seq[BatchRow], table_rows: np.ndarray) -> ForwardBatch:
        size = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        embed_positions: list[int] = []
        embed_values: list[torch.Tensor] = []
        for row in rows:
            sequence = row.sequence
            end = row.start + len(row.tokens)
            embedded = sequence.job.embedding_rows
            if embedded:
                for offset, token in enumerate(row.tokens):
                    if token in embedded:
                        embedding, index = embedded[token]
                        embed_positions.append(len(input_ids) + offset)
                        embed_values.append(embedding.vectors[index])
            input_ids.extend(row.tokens)
            positions.extend(range(row.start, end))
            cu_seqlens.append(cu_seqlens[-1] + len(row.tokens))
            context_lens.append(end)
            logits_indices.extend(range(cu_seqlens[-1] - row.num_logits, cu_seqlens[-1]))
        ids = np.asarray(input_ids, dtype=np.int64)
        embeddings = None
        if embed_positions:
            ids[embed_positions] = 0
            embeddings = (torch.tensor(embed_positions, device=self.device), torch.stack(embed_values).to(self.device))
        pos = np.asarray(positions, dtype=np.int64)
        token_rows = np.repeat(table_rows, np.diff(cu_seqlens))
        slots = self._tables[token_rows, pos // size] * size + pos % size
        width = -(-max(context_lens) // size)
        batch = self._to_device(ids, pos, np.asarray(cu_seqlens), np.asarray(context_lens),
                                self._tables[table_rows, :width], slots, np.asarray(logits_indices, dtype=np.int64),
                                embeddings)
        spans = _bidirectional_spans(rows)
        return replace(batch, bidirectional=spans) if spans is not None else batch

    def _to_device(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        cu_seqlens: np.ndarray,
        context_lens: np.ndarray,
        page_table: np.ndarray,
        slots: np.ndarray,
        logits_indices: np.ndarray,
        embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> ForwardBatch:
        def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(self.device, dtype, non_blocking=True)

        return ForwardBatch(
            input_ids=tensor(input_ids, torch.long),
            positions=tensor(positions, torch.long),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            page_table=tensor(page_table, torch.int32),
            slot_mapping=tensor(slots, torch.long),
            logits_indices=tensor(logits_indices, torch.long),
            embeddings=embeddings,
        )


def _bidirectional_spans(rows: Seq[BatchRow]) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """Per row, the job's bidirectional spans among this step's query positions (the scheduler
    keeps each whole in one chunk); None when no row has one, as in every text-only step."""
    per_row = tuple(tuple(span for span in row.sequence.job.bidirectional_spans
                          if span[0] < row.start + len(row.tokens) and span[1] > row.start) for row in rows)
    return per_row if any(per_row) else None


class ModelRunner:
    """The main model and its cache, plus an optional draft model on the same
    pages; both forwards go through one BatchBuilder."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        max_rows: int,
        max_seq_len: int,
        draft_model: CausalLM | None = None,
        draft_cache: KVCache | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.draft_model = draft_model
        self.draft_cache = draft_cache
        self.device = cache.k.device
        max_pages = -(-max_seq_len // cache.page_size) + 1
        self.builder = BatchBuilder(cache.page_size, max_rows, max_pages, self.device)
        wanted = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        capability = devices.current(self.device).capability if wanted and self.device.type == "cuda" else None
        graphed = wanted and graphable(model, capability)
        self.graphs = DecodeGraphs(model, max_rows, max_pages, self.device) if graphed else None

    def release(self, serial: int) -> None:
        self.builder.release(serial)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The main model over the rows (self.builder.build's batch) -> fp32 logits of the positions
        asked for; the draft model (if any) computes its K/V for the same positions in the same step."""
        model = _bound(self.model, self.cache)
        graphed = self.graphs is not None and batch.lora is None and self.graphs.supports(batch)
        logits = self.graphs.run(batch) if graphed and self.graphs is not None else model(batch)
        if self.draft_model is not None and self.draft_cache is not None:
            # the draft model runs without the rows' adapters (its linears have other shapes)
            no_logits = replace(batch, logits_indices=batch.logits_indices[:0], lora=None)
            _bound(self.draft_model, self.draft_cache)(no_logits)
        return logits

    def draft_forward(self, rows: Seq[BatchRow], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The draft model alone over one-token rows -> its logits. input_ids: the rows' tokens on the
        device, in place of the rows' own (a draft position's input is the draw of the position
        before it, never read back: engine/spec_decode.py)."""
        if self.draft_model is None or self.draft_cache is None:
            raise RuntimeError("no draft model")
        batch = self.builder.build(rows, adapters=False)
        if input_ids is not None:
            batch = replace(batch, input_ids=input_ids)
        return _bound(self.draft_model, self.draft_cache)(batch)


def _bound(model: CausalLM, cache: KVCache) -> CausalLM:
    """The model with this cache bound: bound once, and again only when another
    runner sharing the model (a Generator built over the same model) bound its own."""
    if model.bound_cache is not cache:
        model.bind_cache(cache)
    return model
