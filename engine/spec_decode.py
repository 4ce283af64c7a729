"""Speculative decoding: propose draft tokens cheaply, verify them all in one forward of the main model.

Drafters: n-gram (prompt-lookup: the tokens that followed the latest earlier copy of the
context's suffix) or a smaller draft model of the same tokenizer, run autoregressively over
the job's own pages in the draft cache.

Verification replays the plain path (vLLM's and exllamav2's greedy rule, extended to sampled
jobs): the main model's logits at the k + 1 verify positions are sampled by the batched sampler
as plain steps would sample them (same settings, same context with the draft tokens before
each position, and the same counter-based uniform for the job's token n), and the draft is kept
while it equals those tokens; the first difference, or the token after a fully kept draft, is
the step's last token. So a job emits exactly the tokens it would have emitted without
speculation (identical text for a seed, whether or not a step speculated), and the tokens are
distributed as the job's settings say. A draft model drawing its token n with the same uniform
makes its draft agree with the main model wherever the two distributions' inverse CDFs agree
at that uniform (common random numbers), which keeps acceptance high for sampled jobs too. This
departs from rejection sampling (Leviathan et al., 2023), which accepts somewhat more drafts of
a draft model but draws from a different random stream than the plain path.

Mirostat's mu moves with each token, so a verify position cannot know it before the token
before it is decided: the scheduler's draft room is not used for such jobs (stateful settings).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.batch_sampler import BatchSampler
from engine.model_runner import BatchRow, ModelRunner
from engine.sampling_state import SampleRow, SamplingState
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence

NGRAM_SEARCH_WINDOW = 2048


def ngram_draft(tokens: Seq[int], max_ngram: int, num_draft: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest
    suffix (up to max_ngram tokens) of the context, as prompt-lookup decoding
    does. The copy runs on into its own output, so a loop of period p still
    yields num_draft tokens rather than p."""
    context = list(tokens[-NGRAM_SEARCH_WINDOW:])
    length = len(context)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = context[-n:]
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                followed = context[start + n :]
                return [followed[j % len(followed)] for j in range(num_draft)]
    return []


def accept(draft: Seq[int], sampled: Seq[int]) -> list[int]:
    """The tokens a verified step emits: the draft while it equals what the main model's rows
    sampled (sampled[i]: the token drawn after draft[:i]), then the first sampled token that differs
    (or the one after the whole draft)."""
    kept = 0
    while kept < len(draft) and sampled[kept] == draft[kept]:
        kept += 1
    return [*draft[:kept], sampled[kept]]


def verify_rows(sequence: Sequence, state: SamplingState, draft: Seq[int]) -> list[SampleRow]:
    """The k + 1 sampler rows that verify a draft of k tokens: position i draws the job's token
    num_generated + i after draft[:i], under the constraint's mask there (if the job has one)."""
    generated = sequence.num_generated
    masks = state.constraint.draft_masks(draft) if state.constraint is not None else None
    return [SampleRow(sequence, state, generated + i, tuple(draft[:i]), commit=False,
                      allowed=None if masks is None else masks[i]) for i in range(len(draft) + 1)]


@dataclass(frozen=True)
class Drafter:
    """Proposes draft tokens into the room the scheduler left (ScheduledSequence.draft_room)."""

    runner: ModelRunner
    sampler: BatchSampler
    vocab_size: int
    use_ngram: bool
    max_ngram: int
    num_draft_tokens: int

    def propose(self, items: Seq[ScheduledSequence], states: dict[int, SamplingState]) -> dict[int, list[int]]:
        """serial -> draft tokens, for the jobs the scheduler left room for (stateful jobs never draft);
        a constrained job's draft stops where its grammar would refuse it."""
        if not self.use_ngram and self.runner.draft_model is None:
            return {}
        items = [item for item in items if item.draft_room and not item.sequence.job.gen_settings.stateful]
        if not items:
            return {}
        if self.use_ngram:
            drafts = {item.sequence.serial: self._ngram(item.sequence)[: item.draft_room] for item in items}
        else:
            drafts = self._with_model(items, states)
        for serial, draft in drafts.items():
            constraint = states[serial].constraint
            if constraint is not None and draft:
                drafts[serial] = constraint.valid_prefix(draft)
        return {serial: draft for serial, draft in drafts.items() if draft}

    def _ngram(self, sequence: Sequence) -> list[int]:
        draft = ngram_draft(sequence.token_ids, self.max_ngram, self.num_draft_tokens)
        # the model never emits reserved (embedding) ids: a draft through one is cut there
        return list(itertools.takewhile(lambda t: t < self.vocab_size, draft))

    @torch.inference_mode()
    def _with_model(self, items: Seq[ScheduledSequence], states: dict[int, SamplingState]) -> dict[int, list[int]]:
        """Run the draft model autoregressively, one batched forward per draft position, over the
        sequences' own pages in the draft cache; each draft token is drawn as the main model's
        would be (the job's settings and its uniform for that token), without moving any state.

        The draws stay on the device, each position's the next one's input, and are read back once
        for the whole draft (docs/gpu.md's budget). So what the host decides from the tokens cannot
        see a draw before that read: past the first position a constrained job drafts without its
        grammar's mask (propose() cuts the draft where the grammar refuses it), and DRY or a ranged
        repetition penalty reads the job's context without the draft; the penalties kept on the
        device count the draft (BatchSampler.sample's `drafted`). A draft ends at the first
        position nothing could be drawn for. Verification decides what is kept, so none of this
        changes a job's tokens, only how many drafts are accepted."""
        items = sorted(items, key=lambda item: -item.draft_room)  # those drafting at a position come first
        sequences = [item.sequence for item in items]
        rooms = [item.draft_room for item in items]
        drafted = torch.full((len(items), rooms[0]), -1, dtype=torch.long, device=self.runner.device)
        for step in range(rooms[0]):
            active = sequences[: sum(room > step for room in rooms)]
            before = drafted[: len(active), :step]
            logits = self.runner.draft_forward(
                [BatchRow(s, len(s.token_ids) - 1 + step, [s.token_ids[-1]], 1) for s in active],
                before[:, -1].clamp(min=0) if step else None)
            rows = [SampleRow(s, states[s.serial], s.num_generated + step, commit=False) for s in active]
            drafted[: len(active), step] = self.sampler.sample(logits, rows, before if step else None)
        return {sequence.serial: list(itertools.takewhile(lambda t: t >= 0, tokens[:room]))
                for sequence, room, tokens in zip(sequences, rooms, drafted.tolist(), strict=True)}
