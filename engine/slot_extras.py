"""The persistent sampler's per-slot state for exllamav2's further samplers.

BatchSampler keeps the common settings of every running job in slot tensors (see
engine.batch_sampler); this holds what the samplers of steps 2 and 4-13 of
engine.sampling's pipeline add, so that a batch none of whose jobs uses them pays
nothing for them:

- the numbers of ROW_PARAMS (typical, tfs, skew, ...) for every slot, read only when
  some running job uses one of those steps;
- mirostat's mu per slot, updated on the device from each draw, with the job's mu before
  each of its tokens kept in its SamplingState (mu_history): a job
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

import torch

from engine.sampler_settings import SamplerSettings
from engine.sampling import BatchInputs, dry_inputs, repetition_weights
from engine.sampling_state import SampleRow, SamplingState


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
        self._mirostat: dict[int, SamplingState] = {}  # slot -> its mirostat job's state

    def add(self, slot: int, row: SampleRow) -> None:
        """A job took the slot: write its numbers, its mu and its XTC mask there."""
        settings = row.sequence.job.gen_settings
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
            history = row.state.mu_history
            if not history:
                history.append(torch.tensor(2.0 * settings.mirostat_tau, device=self.device))
            del history[row.draw + 1 :]
            self.mirostat_mu[slot] = history[-1]
            self._mirostat[slot] = row.state
        if sampled and settings._xtc and settings.xtc_ignore_tokens and self.xtc_ignore is None:
            self.xtc_ignore = torch.zeros(self.row_params.shape[0], self.vocab_size, dtype=torch.bool,
                                          device=self.device)
        if self.xtc_ignore is not None:
            self.xtc_ignore[slot] = False
            if sampled and settings._xtc and settings.xtc_ignore_tokens:
                self.xtc_ignore[slot, list(settings.xtc_ignore_tokens)] = True

    def release(self, slot: int) -> None:
        """The job left its slot (a mirostat job's mu history stays in its SamplingState)."""
        self._settings.pop(slot, None)
        self._later.discard(slot)
        self._windowed.discard(slot)
        self._drying.discard(slot)
        self._mirostat.pop(slot, None)

    def fill(self, inputs: BatchInputs, index: torch.Tensor, slots: list[int], rows: Seq[SampleRow]) -> None:
        """Put the batch's extra inputs into inputs (nothing when no running job uses them)."""
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
                [(rows[i].context, self._settings[slots[i]]) for i in windowed], self.vocab_size, self.device)
            inputs.repetition_weight, inputs.seen = weight, None
        drying = [i for i, slot in enumerate(slots) if slot in self._drying] if self._drying else []
        if drying:
            inputs.dry = dry_inputs([(i, rows[i].context, self._settings[slots[i]]) for i in drying],
                                    self.vocab_size, self.device)

    def drawn(self, index: torch.Tensor, mirostat_mu: torch.Tensor | None, rows: Seq[SampleRow]) -> None:
        """After a draw: the batch's mirostat mu as choose() moved it, also recorded as each
        mirostat job's mu before its next token (mirostat jobs never draft, so their rows commit)."""
        if mirostat_mu is not None and self.mirostat_mu is not None and self._mirostat:
            self.mirostat_mu[index] = mirostat_mu
            for i, row in enumerate(rows):
                if row.state.mu_history and row.sequence.job.gen_settings.mirostat:
                    row.state.mu_history.append(mirostat_mu[i].clone())
