"""What the sampler reads of one job beyond its tokens and settings, the rows it samples, and how a
step's tokens are appended (stop tokens, max_new_tokens, the grammar)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.constraints import ConstraintState
from engine.sequence import Sequence


@dataclass(eq=False)
class SamplingState:
    """seed: the job's random stream (a draw's uniform hashes (seed, draw index)); stop_token_ids:
    blocked while min_new_tokens is not reached; constraint: the grammar's matcher; banned_at:
    generated-token index -> token ids a banned-string rewind banned there (replaced, never
    mutated, since the sampler may read it on the overlap thread); heal_mask: token healing's
    [vocab] bool of the tokens the first generated one may be (on the CPU); mu_history:
    mirostat's mu before each generated token (entry n: before token n)."""

    seed: int
    stop_token_ids: frozenset[int]
    constraint: ConstraintState | None = None
    banned_at: dict[int, frozenset[int]] = field(default_factory=dict)
    heal_mask: torch.Tensor | None = None
    mu_history: list[torch.Tensor] = field(default_factory=list)
    _row: SampleRow | None = field(default=None, repr=False)

    def next_row(self, sequence: Sequence) -> SampleRow:
        """The row that draws the job's next token: one per job, its draw moved each step (vLLM v1's
        persistent batch: nothing is built per job per step). A step's sampling, and everything that
        reads its rows, is done before the next step's rows are made."""
        row = self._row
        if row is None:
            row = self._row = SampleRow(sequence, self, 0)
        row.draw = len(sequence.token_ids) - sequence.num_prompt_tokens
        return row

    def ban(self, origin: int, token: int) -> None:
        """A banned-string rewind to generated token `origin`: `token` is banned there, and the bans
        past it go (the text after it is regenerated). Replaces banned_at (see above)."""
        bans = {position: ids for position, ids in self.banned_at.items() if position < origin}
        bans[origin] = self.banned_at.get(origin, frozenset()) | {token}
        self.banned_at = bans


@dataclass(slots=True)
class SampleRow:
    """One draw: the job's token number `draw` (counting generated tokens from 0), in a context
    of its tokens plus `pending` (draft tokens not yet accepted, for verify and draft rows).
    commit: the drawn token is the job's (plain rows), so counts and mirostat's mu move with it;
    verify and draft rows leave the state alone (the step records what verification keeps).
    allowed: a [vocab] bool mask this row obeys instead of the constraint's current mask. Not frozen:
    a job's plain row is kept across steps (SamplingState.next_row), its draw moved once a step."""

    sequence: Sequence
    state: SamplingState
    draw: int
    pending: tuple[int, ...] = ()
    commit: bool = True
    allowed: torch.Tensor | None = None

    @property
    def context(self) -> list[int]:
        """Prompt, generated and pending tokens: what context-dependent penalties read."""
        tokens = self.sequence.token_ids
        return [*tokens, *self.pending] if self.pending else tokens

    @property
    def suppressed(self) -> tuple[int, ...]:
        """Token ids blocked at this draw: stop tokens before min_new_tokens, a rewind's bans."""
        blocked: tuple[int, ...] = ()
        if self.draw < self.sequence.job.min_new_tokens:
            blocked = tuple(self.state.stop_token_ids)
        bans = self.state.banned_at.get(self.draw) if self.state.banned_at else None
        return blocked + tuple(bans) if bans else blocked


def ends_with(sequence: Sequence, state: SamplingState, token: int, generated: int) -> bool:
    """Whether the job ends with `token` as its `generated`-th token: max_new_tokens reached, or a
    stop token once min_new_tokens allows stopping."""
    job = sequence.job
    return generated >= job.max_new_tokens or (token in state.stop_token_ids and generated >= job.min_new_tokens)


def append_tokens(sequence: Sequence, state: SamplingState, tokens: list[int]) -> tuple[list[int], bool, bool]:
    """Append a step's tokens up to the first stop token (once min_new_tokens allows stopping) or
    max_new_tokens: (kept, whether the job ended, whether its grammar completed). The grammar consumes
    the kept tokens and starts computing its next mask. Stop strings need the text: the output
    processor finds them."""
    before = sequence.num_generated
    kept, done = tokens, False
    for i, token in enumerate(tokens, 1):
        if ends_with(sequence, state, token, before + i):
            kept, done = tokens[:i], True
            break
    complete = False
    if state.constraint is not None:
        taken = state.constraint.consume(kept)
        if state.constraint.complete:
            # Tokens past the grammar's end (an EOS after a verified draft that ended with it) are
            # not kept: plain decoding ends the job where the grammar completes.
            complete = taken < len(kept) or not done
            kept = kept[:taken]
    for token in kept:
        sequence.append(token)
    return kept, done or complete, complete
