"""The engine's sampler: per-job sampling state kept as batch tensors across steps.

engine.sampling's functional API rebuilds every per-row tensor from Python
settings and id lists on each call, which costs O(batch x context) host work
per step. Here (as in vLLM v1's persistent InputBatch) a running job owns a
slot from its first sampled token until it finishes, is cancelled or is
preempted, and the slot's rows of persistent tensors hold its settings
(temperature, top-p, min-p, penalties), its seed and draw counter, its logit
bias, and, when any job uses penalties, the prompt/output token presence and
output counts. Joining or leaving writes one slot; each step gathers the
batch's slots and, after the draw, updates counts and counters on the device
from the sampled ids. The host never reads a tensor back except the sampled ids.
What exllamav2's further samplers add per slot (mirostat's mu, ...) lives in
engine.slot_extras.

Randomness is counter-based: a sampled row's uniform is a hash of (seed,
number of tokens the job has generated), so a seeded job draws the same
tokens whatever shares its batch, and also after a preemption (its slot is
rebuilt with the same counter). The speculative path draws from the job's
torch.Generator instead and reports its tokens through record().
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.constraints import unpack_masks
from engine.outputs import TokenLogprob
from engine.sampling import (
    BatchInputs,
    SamplerSettings,
    allowed_only,
    choose,
    distribution,
    edited_logits,
    raise_empty_distribution,
)
from engine.sequence import Sequence
from engine.slot_extras import SlotExtras

_MASK32 = 0xFFFFFFFF


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

    def to_host(self, ids: Seq[int]) -> dict[int, TokenLogprob]:
        """row -> the TokenLogprob of the token ids[i] it took (with its own number of alternatives;
        tokens the job could not take, log-probability -inf, are not alternatives). One read-back."""
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else [[]] * len(self.rows)
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[]] * len(self.rows)
        return {
            row: TokenLogprob(ids[i], chosen[i], tuple(
                (t, v) for t, v in zip(top_ids[i][:k], values[i][:k], strict=True) if v != -math.inf))
            for i, (row, k) in enumerate(zip(self.rows, self.ks, strict=True))
        }


# Columns of the float parameter table.
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE, _TOP_A = range(7)


class BatchSampler:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.params = torch.zeros(max_slots, 7, dtype=torch.float32, device=device)
        # seed low 32 bits, seed high bits, tokens generated so far (the draw counter)
        self.counters = torch.zeros(max_slots, 3, dtype=torch.int64, device=device)
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.extras = SlotExtras(max_slots, vocab_size, device)  # exllamav2's further samplers
        self._free = list(range(max_slots - 1, -1, -1))
        self._slots: dict[int, int] = {}
        self._settings: list[SamplerSettings] = [SamplerSettings.greedy()] * max_slots
        self._sampled: set[int] = set()
        self._edited: set[int] = set()
        # Slots of jobs with a constraint / asking for logprobs: rows are looked for only when some are.
        self._constrained: set[int] = set()
        self._logprobs_wanted: set[int] = set()
        self._suppressing: dict[int, Sequence] = {}
        self._banning: dict[int, Sequence] = {}  # jobs with banned strings: tokens a rewind banned
        self._healing: dict[int, Sequence] = {}  # token healing: the first token is one of heal_mask's
        self._last: tuple[torch.Tensor, torch.Tensor, list[Sequence]] | None = None
        self.last_logprobs: SampledLogprobs | None = None

    @property
    def num_slots_used(self) -> int:
        return len(self._slots)

    def release(self, serial: int) -> None:
        """The job left the running batch (finished, cancelled or preempted)."""
        slot = self._slots.pop(serial, None)
        if slot is None:
            return
        self._free.append(slot)
        self.extras.release(slot)
        self._sampled.discard(slot)
        self._edited.discard(slot)
        self._constrained.discard(slot)
        self._logprobs_wanted.discard(slot)
        self._suppressing.pop(serial, None)
        self._banning.pop(serial, None)
        self._healing.pop(serial, None)

    @property
    def _bans_pending(self) -> bool:
        """Whether a job with banned strings has had a rewind (only then has it tokens to ban),
        so such jobs stay on the plain-argmax path until one happens."""
        return any(sequence.banned_at for sequence in self._banning.values())

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sequences: Seq[Sequence]) -> torch.Tensor:
        """One token per row ([B] int64 on the device); a row that no token can be
        drawn for (every logit masked or non-finite) gets -1, see raise_for_row."""
        slots = self._slots_of(sequences)
        index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        self.counters[index, 2] += 1
        constrained = [i for i, slot in enumerate(slots) if slot in self._constrained] if self._constrained else []
        wanted = [i for i, slot in enumerate(slots) if slot in self._logprobs_wanted] if self._logprobs_wanted else []
        healing = [i for i, s in enumerate(sequences) if s.serial in self._healing and s.num_generated == 0
                   ] if self._healing else []
        if (not self._sampled and not self._edited and not self._suppressing and not self._bans_pending
                and not constrained and not healing):
            ids = logits.argmax(dim=-1)
            self.last_logprobs = self._logprobs(logits, ids, index, wanted, sequences) if wanted else None
            return ids
        inputs = self._inputs(index, slots, sequences)
        if constrained or healing:
            inputs.allowed = self._allowed(constrained, healing, sequences)
        x, bad = edited_logits(logits, inputs)
        uniform = self._uniforms(index) if self._sampled else None
        ids, mirostat_mu = choose(x, inputs, uniform)
        self.extras.drawn(index, mirostat_mu)
        if self.counts is not None:
            self.counts.index_put_((index, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        if self.seen is not None:
            self.seen[index, ids] = True
        self._last = (logits, x, list(sequences))
        self.last_logprobs = self._logprobs(x, ids, index, wanted, sequences) if wanted else None
        return torch.where(bad, -1, ids)

    @torch.inference_mode()
    def distribution(self, logits: torch.Tensor, sequences: Seq[Sequence]) -> torch.Tensor:
        """The [B, V] distribution the next sample() draws each row from (greedy rows: one-hot;
        constraints and token healing aside), without drawing or moving any state."""
        slots = self._slots_of(sequences)
        index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        inputs = self._inputs(index, slots, sequences)
        return distribution(edited_logits(logits, inputs)[0], inputs)

    def _slots_of(self, sequences: Seq[Sequence]) -> list[int]:
        """Each sequence's slot, given to it (and written) on its first sampled token."""
        slots = [self._slots.get(s.serial) for s in sequences]
        return [self._add(sequence) if slot is None else slot for sequence, slot in zip(sequences, slots, strict=True)]

    def _logprobs(self, x: torch.Tensor, ids: torch.Tensor, index: torch.Tensor, wanted: list[int],
                  sequences: Seq[Sequence]) -> SampledLogprobs:
        """The wanted rows' log-probabilities of their sampled ids and their top alternatives, on the device."""
        rows = torch.tensor(wanted, device=self.device)
        return SampledLogprobs.compute(x[rows], self.params[index[rows], _TEMPERATURE], ids[rows], wanted,
                                       [sequences[i].job.top_logprobs for i in wanted])

    def raise_for_row(self, row: int) -> None:
        """Raise the error that names why row of the last sample() had nothing to draw."""
        if self._last is None:
            raise RuntimeError("no sample() to explain")
        logits, x, sequences = self._last
        sequence = sequences[row]
        suppress = sequence.stop_token_ids if sequence.num_generated < sequence.job.min_new_tokens else ()
        raise_empty_distribution(row, logits, x, sequence.job.gen_settings, tuple(suppress))

    @torch.inference_mode()
    def record(self, sequence: Sequence, tokens: Seq[int]) -> None:
        """Tokens a job emitted outside sample() (speculative verification)."""
        slot = self._slots.get(sequence.serial)
        if slot is None:
            return
        self.counters[slot, 2] += len(tokens)
        ids = torch.tensor([t for t in tokens if 0 <= t < self.vocab_size], dtype=torch.long, device=self.device)
        if self.counts is not None:
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        if self.seen is not None:
            self.seen[slot, ids] = True

    def _add(self, sequence: Sequence) -> int:
        """Give a job a slot and write its settings and token statistics there."""
        if not self._free:
            raise RuntimeError("more sampling jobs than slots (max_batch_size)")
        slot = self._free.pop()
        self._slots[sequence.serial] = slot
        settings = sequence.job.gen_settings
        self._settings[slot] = settings
        self.params[slot] = torch.tensor([
            settings.temperature, settings.top_p, settings.min_p, settings.repetition_penalty,
            settings.frequency_penalty, settings.presence_penalty, settings.top_a,
        ])
        seed = sequence.seed
        self.counters[slot] = torch.tensor([seed & _MASK32, seed >> 32, sequence.num_generated])
        if not settings.is_greedy:
            self._sampled.add(slot)
        if settings._edits_logits:
            self._edited.add(slot)
        if sequence.constraint is not None:
            self._constrained.add(slot)
        if sequence.job.logprobs:
            self._logprobs_wanted.add(slot)
        if sequence.num_generated < sequence.job.min_new_tokens and sequence.stop_token_ids:
            self._suppressing[sequence.serial] = sequence
        if sequence.job.banned_strings:
            self._banning[sequence.serial] = sequence
        if sequence.heal_mask is not None:
            self._healing[sequence.serial] = sequence
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
                self.bias[slot] = allowed_only(settings.allowed_token_ids, vocab, self.device)
            if settings.token_bias:
                biased = torch.tensor(list(settings.token_bias.keys()), dtype=torch.long, device=self.device)
                self.bias[slot, biased] += torch.tensor(list(settings.token_bias.values()), device=self.device)
            if settings.banned_token_ids:
                self.bias[slot, list(settings.banned_token_ids)] = -torch.inf
        self.extras.add(slot, sequence)
        return slot

    def _inputs(self, index: torch.Tensor, slots: list[int], sequences: Seq[Sequence]) -> BatchInputs:
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
        if self._suppressing or self._bans_pending:
            inputs.masked = self._suppressed(sequences)
        self.extras.fill(inputs, index, slots, sequences)
        return inputs

    def _allowed(self, constrained: list[int], healing: list[int], sequences: Seq[Sequence]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, [R, V] bool): the constrained jobs' masks (computed while the forward ran), then
        the token-healing jobs' masks for their first token."""
        parts = []
        if constrained:
            states = [sequences[row].constraint for row in constrained]
            parts.append(unpack_masks([state for state in states if state is not None], self.vocab_size))
        for row in healing:
            mask = sequences[row].heal_mask
            assert mask is not None
            parts.append(mask[None])
        allowed = torch.cat(parts) if len(parts) > 1 else parts[0]
        return torch.tensor(constrained + healing, device=self.device), allowed.to(self.device, non_blocking=True)

    def _suppressed(self, sequences: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, ids) of stop tokens blocked while min_new_tokens is not reached, and of tokens a
        banned-string rewind banned at this position."""
        for serial, sequence in list(self._suppressing.items()):
            if sequence.num_generated >= sequence.job.min_new_tokens:
                del self._suppressing[serial]
        if not self._suppressing and not self._bans_pending:
            return None
        rows: list[int] = []
        ids: list[int] = []
        for row, sequence in enumerate(sequences):
            blocked = [*sequence.stop_token_ids] if sequence.serial in self._suppressing else []
            if sequence.serial in self._banning:
                blocked += sequence.banned_now
            blocked = [t for t in blocked if 0 <= t < self.vocab_size]
            rows += [row] * len(blocked)
            ids += blocked
        if not rows:
            return None
        return torch.tensor(rows, device=self.device), torch.tensor(ids, device=self.device)

    def _uniforms(self, index: torch.Tensor) -> torch.Tensor:
        """[B] uniforms in [0, 1): a hash of each row's seed and draw counter (24 bits, like torch.rand)."""
        counters = self.counters[index]
        mixed = _mix32(counters[:, 0] ^ _mix32(counters[:, 1] ^ _mix32((counters[:, 2] - 1) & _MASK32)))
        return (mixed >> 8).to(torch.float32) * (1.0 / (1 << 24))


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
