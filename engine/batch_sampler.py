"""The engine's sampler: per-job sampling state kept as batch tensors across steps.

Rebuilding every per-row tensor from Python settings and id lists on each call
would cost O(batch x context) host work per step. Here (as in vLLM v1's
persistent InputBatch) a running job owns a
slot from its first sampled token until it finishes, is cancelled or is
preempted, and the slot's rows of persistent tensors hold its settings
(temperature, top-p, min-p, penalties), its seed, its logit bias, and, when
any job uses penalties, the prompt/output token presence and output counts.
Joining or leaving writes one slot; each step gathers the batch's slots and,
after the draw, updates the counts on the device from the sampled ids. The
host never reads a tensor back except the sampled ids.
What exllamav2's further samplers add per slot (mirostat's mu, ...) lives in
engine.slot_extras.

Randomness is counter-based: a row's uniform is a hash of (seed, the index of
the token it draws among the job's generated tokens), so a seeded job draws the
same tokens whatever shares its batch, after a preemption, and whether or not a
step speculates: a verify row for the job's token n (after n - g accepted draft
tokens) uses the very uniform a plain step would use for token n, and a draft
model draws its token n with it too (engine/spec_decode.py). Rows carry their
context (engine/sampling_state.SampleRow): draft tokens not yet accepted count
for the penalties of the rows after them, and only committed rows move the
slot's counts and mirostat's mu; verification reports what it kept through
record().
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.constraints import unpack_masks
from engine.outputs import TokenLogprob
from engine.sampler_settings import SamplerSettings
from engine.sampling import (
    BatchInputs,
    choose,
    distribution,
    edited_logits,
    raise_empty_distribution,
)
from engine.sampling_state import SampleRow
from engine.slot_extras import SlotExtras

_MASK32 = 0xFFFFFFFF
_DRAW_OFFSET = 0x9E3779B9  # 2^32 / golden ratio: any odd constant that hashes away from 0 would do


@dataclass(frozen=True)
class SampledLogprobs:
    """Log-probabilities of sampled tokens and their best alternatives, still on the device:
    rows[i] (a row of the sampled batch) took a token whose log-probability is chosen[i], and
    wants ks[i] alternatives."""

    rows: list[int]
    ks: list[int]
    chosen: torch.Tensor  # [R]
    top_values: torch.Tensor | None  # [R, max(ks)], best first
    top_ids: torch.Tensor | None

    @classmethod
    def compute(cls, x: torch.Tensor, temperature: torch.Tensor, ids: torch.Tensor, rows: list[int],
                ks: list[int]) -> SampledLogprobs:
        """From edited logits x [R, V] at each row's temperature ([R]; 0 for greedy reads as 1) and the
        ids [R] the rows took: the distribution each row samples from, before truncation."""
        temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        logprobs = torch.log_softmax(x.float() / temperature[:, None], dim=-1)
        chosen = logprobs.gather(1, ids.clamp(min=0)[:, None]).squeeze(1)
        top = logprobs.topk(max(ks), dim=-1) if max(ks) else None
        return cls(rows, ks, chosen, top.values if top else None, top.indices if top else None)

    def read_back(self, tokens: torch.Tensor) -> tuple[list[int], dict[int, TokenLogprob]]:
        """The step's sampled tokens ([B] on the device) and, row -> the TokenLogprob of the token
        it took (with its own number of alternatives; tokens the job could not take,
        log-probability -inf, are not alternatives), in one read-back: everything is packed into one
        float64 tensor first (token ids are exact in float64)."""
        width = 1 + 2 * max(self.ks)
        parts = [tokens.double(), self.chosen.double()[:, None]]
        if self.top_values is not None and self.top_ids is not None:
            parts[1] = torch.cat([parts[1], self.top_values.double(), self.top_ids.double()], dim=1)
        host = torch.cat([parts[0], parts[1].flatten()]).tolist()
        ids = [int(t) for t in host[: tokens.shape[0]]]
        rows = [host[tokens.shape[0] + i * width : tokens.shape[0] + (i + 1) * width] for i in range(len(self.rows))]
        top = (width - 1) // 2
        return ids, {
            row: TokenLogprob(ids[row], values[0], tuple(
                (int(t), v) for t, v in zip(values[1 + top : 1 + top + k], values[1 : 1 + k], strict=True)
                if v != -math.inf))
            for row, k, values in zip(self.rows, self.ks, rows, strict=True)
        }


# Columns of the float parameter table.
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE, _TOP_A = range(7)


class BatchSampler:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.params = torch.zeros(max_slots, 7, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_slots, 2, dtype=torch.int64, device=device)  # seed low 32 bits, high bits
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.extras = SlotExtras(max_slots, vocab_size, device)  # exllamav2's further samplers
        self._free = list(range(max_slots - 1, -1, -1))
        self._slots: dict[int, int] = {}
        self._settings: list[SamplerSettings] = [SamplerSettings.greedy()] * max_slots
        self._sampled: set[int] = set()
        self._edited: set[int] = set()
        # Slots of jobs with a constraint / token healing / asking for logprobs / with min_new_tokens or
        # banned strings: rows are looked at one by one only when some such job runs.
        self._constrained: set[int] = set()
        self._healing: set[int] = set()
        self._logprobs_wanted: set[int] = set()
        self._suppressing: set[int] = set()
        self._last: tuple[torch.Tensor, torch.Tensor, list[SampleRow]] | None = None
        self.last_logprobs: SampledLogprobs | None = None

    def release(self, serial: int) -> None:
        """The job left the running batch (finished, cancelled or preempted)."""
        slot = self._slots.pop(serial, None)
        if slot is None:
            return
        self._free.append(slot)
        self.extras.release(slot)
        for slots in (self._sampled, self._edited, self._constrained, self._healing, self._logprobs_wanted,
                      self._suppressing):
            slots.discard(slot)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow], drafted: torch.Tensor | None = None
               ) -> torch.Tensor:
        """One token per row ([B] int64 on the device); a row that no token can be drawn for (every
        logit masked or non-finite) gets -1, see raise_for_row. drafted: [B, k] a draft model's
        earlier draws before each row, still on the device (-1: none): the penalties kept on the
        device count them as they count `pending` tokens, and the rows ignore their grammar, whose
        mask after those draws the host cannot know (engine/spec_decode.py)."""
        slots = self._slots_of(rows)
        index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        wanted = [i for i, slot in enumerate(slots) if slot in self._logprobs_wanted] if self._logprobs_wanted else []
        constrained = ([i for i, slot in enumerate(slots) if slot in self._constrained]
                       if self._constrained and drafted is None else [])
        healing = [i for i, r in enumerate(rows) if r.draw == 0 and slots[i] in self._healing] if self._healing else []
        suppressed = self._suppressed(rows, slots) if self._suppressing else None
        if (not self._sampled and not self._edited and suppressed is None and not constrained and not healing):
            peak, ids = logits.max(dim=-1)  # a NaN or infinite row fails its job alone (raise_for_row)
            self._last = (logits, logits, list(rows))
            self.last_logprobs = self._logprobs(logits, ids, index, wanted, rows) if wanted else None
            return torch.where(torch.isfinite(peak), ids, -1)
        inputs = self._inputs(index, slots, rows, [i for i, r in enumerate(rows) if r.pending], drafted)
        inputs.masked = suppressed
        if constrained or healing:
            inputs.allowed = self._allowed(constrained, healing, rows)
        x, bad = edited_logits(logits, inputs)
        uniform = self._uniforms(index, rows) if self._sampled else None
        ids, mirostat_mu = choose(x, inputs, uniform)
        committed = [i for i, r in enumerate(rows) if r.commit]
        if committed:
            self.extras.drawn(index, mirostat_mu, rows)
            self._count(index if len(committed) == len(rows) else index[committed],
                        ids if len(committed) == len(rows) else ids[committed])
        self._last = (logits, x, list(rows))
        self.last_logprobs = self._logprobs(x, ids, index, wanted, rows) if wanted else None
        return torch.where(bad, -1, ids)

    @torch.inference_mode()
    def distribution(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> torch.Tensor:
        """The [B, V] distribution the next sample() draws each row from (greedy rows: one-hot;
        constraints and token healing aside), without drawing or moving any state."""
        slots = self._slots_of(rows)
        index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        inputs = self._inputs(index, slots, rows, [i for i, r in enumerate(rows) if r.pending])
        inputs.masked = self._suppressed(rows, slots) if self._suppressing else None
        return distribution(edited_logits(logits, inputs)[0], inputs)

    def _slots_of(self, rows: Seq[SampleRow]) -> list[int]:
        """Each row's job's slot, given to it (and written) on its first draw (once, however many of
        its rows the batch holds)."""
        slots = []
        for row in rows:
            slot = self._slots.get(row.sequence.serial)
            slots.append(self._add(row) if slot is None else slot)
        return slots

    def _logprobs(self, x: torch.Tensor, ids: torch.Tensor, index: torch.Tensor, wanted: list[int],
                  rows: Seq[SampleRow]) -> SampledLogprobs:
        """The wanted rows' log-probabilities of their sampled ids and their top alternatives, on the device."""
        at = torch.tensor(wanted, device=self.device)
        return SampledLogprobs.compute(x[at], self.params[index[at], _TEMPERATURE], ids[at], wanted,
                                       [rows[i].sequence.job.top_logprobs for i in wanted])

    def raise_for_row(self, row: int) -> None:
        """Raise the error that names why row of the last sample() had nothing to draw."""
        if self._last is None:
            raise RuntimeError("no sample() to explain")
        logits, x, rows = self._last
        raise_empty_distribution(row, logits, x, rows[row].sequence.job.gen_settings, rows[row].suppressed)

    @torch.inference_mode()
    def record(self, serial: int, tokens: Seq[int]) -> None:
        """Tokens a job emitted outside sample()'s commits (kept by speculative verification)."""
        slot = self._slots.get(serial)
        if slot is None or not tokens:
            return
        ids = torch.tensor([t for t in tokens if 0 <= t < self.vocab_size], dtype=torch.long, device=self.device)
        self._count(torch.full_like(ids, slot), ids)

    def _count(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Committed tokens enter the slots' presence and count tables (penalties read them)."""
        if self.counts is not None:
            self.counts.index_put_((slots, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        if self.seen is not None:
            self.seen[slots, ids] = True

    def _add(self, row: SampleRow) -> int:
        """Give a job a slot and write its settings and token statistics there."""
        if not self._free:
            raise RuntimeError("more sampling jobs than slots (max_batch_size)")
        sequence, state = row.sequence, row.state
        slot = self._free.pop()
        self._slots[sequence.serial] = slot
        job = sequence.job
        settings = job.gen_settings
        self._settings[slot] = settings
        self.params[slot] = torch.tensor([
            settings.temperature, settings.top_p, settings.min_p, settings.repetition_penalty,
            settings.frequency_penalty, settings.presence_penalty, settings.top_a,
        ])
        self.seeds[slot] = torch.tensor([state.seed & _MASK32, state.seed >> 32])
        for wanted, slots in ((not settings.is_greedy, self._sampled), (settings._edits_logits, self._edited),
                              (state.constraint is not None, self._constrained),
                              (state.heal_mask is not None, self._healing),
                              (job.logprobs, self._logprobs_wanted),
                              ((job.min_new_tokens > 0 and bool(state.stop_token_ids)) or bool(job.banned_strings),
                               self._suppressing)):
            if wanted:
                slots.add(slot)
        vocab = self.vocab_size
        ids = torch.tensor([t for t in sequence.token_ids if 0 <= t < vocab], dtype=torch.long, device=self.device)
        outputs = torch.tensor([t for t in sequence.output_ids if 0 <= t < vocab], dtype=torch.long,
                               device=self.device)
        if settings.repetition_penalty != 1.0 and self.seen is None:
            self.seen = torch.zeros(len(self._settings), vocab, dtype=torch.bool, device=self.device)
        if self.seen is not None:
            self.seen[slot] = False
            self.seen[slot, ids] = True
        if (settings.frequency_penalty or settings.presence_penalty) and self.counts is None:
            self.counts = torch.zeros(len(self._settings), vocab, dtype=torch.float32, device=self.device)
        if self.counts is not None:
            self.counts[slot] = 0.0
            self.counts[slot].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.float32))
        if (settings.token_bias or settings.banned_token_ids or settings.allowed_token_ids) and self.bias is None:
            self.bias = torch.zeros(len(self._settings), vocab, dtype=torch.float32, device=self.device)
        if self.bias is not None:
            self.bias[slot] = 0.0
            if settings.allowed_token_ids:
                self.bias[slot] = -torch.inf
                self.bias[slot, list(settings.allowed_token_ids)] = 0.0
            if settings.token_bias:
                biased = torch.tensor(list(settings.token_bias.keys()), dtype=torch.long, device=self.device)
                self.bias[slot, biased] += torch.tensor(list(settings.token_bias.values()), device=self.device)
            if settings.banned_token_ids:
                self.bias[slot, list(settings.banned_token_ids)] = -torch.inf
        self.extras.add(slot, row)
        return slot

    def _inputs(self, index: torch.Tensor, slots: list[int], rows: Seq[SampleRow], pending: list[int],
                drafted: torch.Tensor | None = None) -> BatchInputs:
        params = self.params[index]
        inputs = BatchInputs(
            settings=[self._settings[slot] for slot in slots],
            temperature=params[:, _TEMPERATURE],
            top_p=params[:, _TOP_P],
            min_p=params[:, _MIN_P],
            top_a=params[:, _TOP_A],
        )
        if self._edited:
            if self.bias is not None:
                inputs.bias = self.bias[index]
            if self.seen is not None:
                inputs.repetition_penalty = params[:, _REPETITION]
                inputs.seen = self.seen[index]
            if self.counts is not None:
                inputs.frequency_penalty = params[:, _FREQUENCY]
                inputs.presence_penalty = params[:, _PRESENCE]
                inputs.counts = self.counts[index]
            if pending:
                self._add_pending(inputs, rows, pending)
            if drafted is not None and drafted.shape[1]:
                self._add_drafted(inputs, drafted)
        self.extras.fill(inputs, index, slots, rows)
        return inputs

    def _add_pending(self, inputs: BatchInputs, rows: Seq[SampleRow], pending: list[int]) -> None:
        """Draft tokens before a verify or draft row count for its penalties as if they were generated."""
        at = [i for i in pending for t in rows[i].pending if 0 <= t < self.vocab_size]
        ids = [t for i in pending for t in rows[i].pending if 0 <= t < self.vocab_size]
        if not ids:
            return
        where = (torch.tensor(at, device=self.device), torch.tensor(ids, device=self.device))
        if inputs.seen is not None:
            inputs.seen[where] = True
        if inputs.counts is not None:
            inputs.counts.index_put_(where, torch.ones(len(ids), device=self.device), accumulate=True)

    def _add_drafted(self, inputs: BatchInputs, drafted: torch.Tensor) -> None:
        """Draft tokens on the device ([B, k], -1: none) count for the penalties as pending ones do."""
        if inputs.seen is None and inputs.counts is None:
            return
        hits = torch.zeros(drafted.shape[0], self.vocab_size, device=self.device).scatter_add_(
            1, drafted.clamp(min=0), (drafted >= 0).float())
        if inputs.seen is not None:
            inputs.seen |= hits > 0
        if inputs.counts is not None:
            inputs.counts += hits

    def _allowed(self, constrained: list[int], healing: list[int], rows: Seq[SampleRow]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, [R, V] bool) in row order: the constrained rows' masks (their own, else their job's
        current one, computed while the forward ran) and the token-healing rows' masks for their
        first token."""
        masks: dict[int, torch.Tensor] = {}
        current = [i for i in constrained if rows[i].allowed is None]
        if current:
            states = [rows[i].state.constraint for i in current]
            unpacked = unpack_masks([state for state in states if state is not None], self.vocab_size)
            masks.update(zip(current, unpacked, strict=True))
        for i in constrained:
            given = rows[i].allowed
            if given is not None:
                masks[i] = given
        for i in healing:
            heal = rows[i].state.heal_mask
            assert heal is not None
            masks[i] = heal
        order = sorted(masks)
        allowed = masks[order[0]][None] if len(order) == 1 else torch.stack([masks[i] for i in order])
        return torch.tensor(order, device=self.device), allowed.to(self.device, non_blocking=True)

    def _suppressed(self, rows: Seq[SampleRow], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, ids) of stop tokens blocked while min_new_tokens is not reached, and of tokens a
        banned-string rewind banned at a row's position."""
        at: list[int] = []
        ids: list[int] = []
        for i, row in enumerate(rows):
            if slots[i] in self._suppressing:
                blocked = [t for t in row.suppressed if 0 <= t < self.vocab_size]
                at += [i] * len(blocked)
                ids += blocked
        if not at:
            return None
        return torch.tensor(at, device=self.device), torch.tensor(ids, device=self.device)

    def _uniforms(self, index: torch.Tensor, rows: Seq[SampleRow]) -> torch.Tensor:
        """[B] uniforms in (0, 1): a hash of each row's seed and draw index, 24 bits centred in their
        interval (never exactly 0, which would take the first token with any mass at all). The draw
        index is offset by a constant before hashing, since the hash maps 0 to 0: seed 0's first draw
        must be as random as any other."""
        seeds = self.seeds[index]
        draws = torch.tensor([r.draw for r in rows], dtype=torch.int64).to(self.device, non_blocking=True)
        mixed = _mix32(seeds[:, 0] ^ _mix32(seeds[:, 1] ^ _mix32((draws ^ _DRAW_OFFSET) & _MASK32)))
        return ((mixed >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), in int64 without overflow."""
    low = (x & 0xFFFF) * constant
    high = (((x >> 16) * constant) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (the lowbias32 finalizer)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
