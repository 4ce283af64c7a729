"""The persistent sampler's per-slot state for exllamav2's further samplers.

BatchSampler keeps the common settings of every running job in slot tensors (see
engine.batch_sampler); this holds what the samplers of steps 2 and 4-13 of
engine.sampling's pipeline add, so that a batch none of whose jobs uses them pays
nothing for them:

- the numbers of ROW_PARAMS (typical, tfs, skew, ...) for every slot, read only when
  some running job uses one of those steps;
- mirostat's mu per slot, updated on the device from each draw, with the job's mu before
  each of its tokens kept under its Sequence (weakly: a finished job leaves nothing): a job
  that takes a slot again with n tokens generated resumes with the mu it had before token
  n, as its seed and draw counter let it resume its random stream. So a preempted job goes
  on with its mu, and a banned-string rewind to token n also takes mu back to token n
  (the token drawn there again sees the mu it first saw, not one moved by tokens since
  taken back);
- the ids XTC never excludes, as a [slots, V] mask built when a job first names some;
- which slots need their context each step: a repetition penalty with a range (its
  weights depend on where tokens are, not only on whether they occur) and DRY. Those
  are computed on the host from the job's own tokens, reading at most range + decay
  (resp. dry_range) of them, since the host holds the tokens and the device holds none.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from weakref import WeakKeyDictionary

import torch

from engine.sampling import BatchInputs, SamplerSettings, dry_inputs, repetition_weights
from engine.sequence import Sequence


class SlotExtras:
    """The extra per-slot sampling state of BatchSampler (see the module docstring)."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.row_params = torch.tensor([SamplerSettings().row_params()] * max_slots, device=device)
        self.mirostat_mu: torch.Tensor | None = None
        self.xtc_ignore: torch.Tensor | None = None
        self._settings: dict[int, SamplerSettings] = {}
        self._later: set[int] = set()  # slots whose sampled rows run steps 4 (smoothing) or 8-13
        self._windowed: set[int] = set()  # repetition_penalty_range
        self._drying: set[int] = set()
        self._mirostat: dict[int, Sequence] = {}  # slot -> its mirostat job
        # a mirostat job's mu before each of its generated tokens (entry n: before token n)
        self._mu_history: WeakKeyDictionary[Sequence, list[torch.Tensor]] = WeakKeyDictionary()
        self._mirostat_rows: list[tuple[int, Sequence]] = []  # the last filled batch's mirostat rows

    def add(self, slot: int, sequence: Sequence) -> None:
        """A job took the slot: write its numbers, its mu and its XTC mask there."""
        settings = sequence.job.gen_settings
        self._settings[slot] = settings
        self.row_params[slot] = torch.tensor(settings.row_params(), device=self.device)
        sampled = not settings.is_greedy
        if sampled and settings._uses_row_params:
            self._later.add(slot)
        if settings._repetition_window:
            self._windowed.add(slot)
        if settings._dry:
            self._drying.add(slot)
        if sampled and settings.mirostat:
            if self.mirostat_mu is None:
                self.mirostat_mu = torch.zeros(self.row_params.shape[0], device=self.device)
            history = self._mu_history.setdefault(sequence, [])
            if not history:
                history.append(torch.tensor(2.0 * settings.mirostat_tau, device=self.device))
            del history[len(sequence.output_ids) + 1 :]
            self.mirostat_mu[slot] = history[-1]
            self._mirostat[slot] = sequence
        if sampled and settings._xtc and settings.xtc_ignore_tokens and self.xtc_ignore is None:
            self.xtc_ignore = torch.zeros(self.row_params.shape[0], self.vocab_size, dtype=torch.bool,
                                          device=self.device)
        if self.xtc_ignore is not None:
            self.xtc_ignore[slot] = False
            if sampled and settings._xtc and settings.xtc_ignore_tokens:
                self.xtc_ignore[slot, list(settings.xtc_ignore_tokens)] = True

    def release(self, slot: int) -> None:
        """The job left its slot (a mirostat job's mu history stays with its sequence)."""
        self._settings.pop(slot, None)
        self._later.discard(slot)
        self._windowed.discard(slot)
        self._drying.discard(slot)
        self._mirostat.pop(slot, None)

    def fill(self, inputs: BatchInputs, index: torch.Tensor, slots: list[int], sequences: Seq[Sequence]) -> None:
        """Put the batch's extra inputs into inputs (nothing when no running job uses them)."""
        self._mirostat_rows = [(i, self._mirostat[slot]) for i, slot in enumerate(slots) if slot in self._mirostat
                               ] if self._mirostat else []
        if self._later:
            inputs.params = self.row_params[index]
            if self.mirostat_mu is not None and self._mirostat:
                inputs.mirostat_mu = self.mirostat_mu[index]
            if self.xtc_ignore is not None:
                inputs.xtc_ignore = self.xtc_ignore[index]
        windowed = [i for i, slot in enumerate(slots) if slot in self._windowed] if self._windowed else []
        if windowed:
            assert inputs.seen is not None  # a windowed job has a repetition penalty, so seen is kept
            weight = inputs.seen.to(torch.float32)
            weight[torch.tensor(windowed, device=self.device)] = repetition_weights(
                [(sequences[i].token_ids, self._settings[slots[i]]) for i in windowed], self.vocab_size, self.device)
            inputs.repetition_weight, inputs.seen = weight, None
        drying = [i for i, slot in enumerate(slots) if slot in self._drying] if self._drying else []
        if drying:
            inputs.dry = dry_inputs([(i, sequences[i].token_ids, self._settings[slots[i]]) for i in drying],
                                    self.vocab_size, self.device)

    def drawn(self, index: torch.Tensor, mirostat_mu: torch.Tensor | None) -> None:
        """After a draw: the batch's mirostat mu as choose() moved it, also recorded as each
        mirostat job's mu before its next token."""
        if mirostat_mu is not None and self.mirostat_mu is not None:
            self.mirostat_mu[index] = mirostat_mu
            for row, sequence in self._mirostat_rows:
                self._mu_history[sequence].append(mirostat_mu[row].clone())
