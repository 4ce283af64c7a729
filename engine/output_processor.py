"""Per-job text: detokenize → token healing → banned strings → stop strings → EngineOutput.

Like vLLM v1's OutputProcessor, it owns each job's text state and returns what it decided
instead of acting on the generator: a job that finished (with its reason and how many of the
step's tokens it keeps), a job to rewind (a banned string appeared), a job that failed (it
rewound too often). The step applies those decisions to the sequence, the sampler and the
scheduler afterwards.

Stop tokens count as generated tokens (token_ids, new_tokens) but never appear in the text;
stop strings never appear in the text either, and tokens after a stop string are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.banned_strings import MAX_REWINDS, BannedStringGuard
from engine.detokenizer import IncrementalDetokenizer
from engine.job import Job
from engine.outputs import EngineOutput, FinishReason, Stage, TokenLogprob
from engine.sequence import Sequence
from engine.stops import StopStringMatcher
from engine.tokenizer import Tokenizer


@dataclass(eq=False)
class RequestState:
    """One job's text as it is released. heal_prefix: the text of the token token healing took off
    the prompt, which the first generated text repeats and which is not emitted again (heal_pending:
    characters of it still to drop); constraint_done_at: the generated-token count at which the
    job's grammar completed."""

    job: Job
    stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    banned_guard: BannedStringGuard | None
    completion: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if the job asks
    # one per prompt token (the first None) if the job asks, filled chunk by chunk in the prefill
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    heal_prefix: str = ""
    heal_pending: int = 0
    constraint_done_at: int | None = None
    rewinds: int = 0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


@dataclass(slots=True)
class StepTokens:
    """Tokens the step appended to a job (already in sequence.token_ids), with their logprobs.
    Not frozen, as SampleRow."""

    sequence: Sequence
    tokens: list[int]
    logprobs: Seq[TokenLogprob] = ()
    constraint_complete: bool = False  # the job's grammar completed with the last of them


@dataclass(frozen=True, slots=True)
class Finished:
    """The job ends with this step's output, keeping its first `keep` generated tokens."""

    serial: int
    keep: int


@dataclass(frozen=True, slots=True)
class Rewind:
    """A banned string appeared: take the job back to generated token `origin` and ban that token there."""

    serial: int
    origin: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The job ends with an error (it kept producing a banned string, rewind after rewind)."""

    serial: int
    message: str


@dataclass
class ProcessedStep:
    outputs: list[EngineOutput] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    rewinds: list[Rewind] = field(default_factory=list)

    def decided(self) -> set[int]:
        """The jobs these decisions end or take back: they keep nothing of a step run meanwhile."""
        return ({f.serial for f in self.finished} | {f.serial for f in self.failed}
                | {r.serial for r in self.rewinds})


@dataclass(slots=True)
class _Released:
    """Text a token (or the end of generation) released, and what it decided: a stop string that
    ends the job, or the generated token to rewind to because a banned string appeared (not frozen,
    as SampleRow)."""

    text: str
    stop_string: str | None = None
    rewind_to: int | None = None


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How one token's release ends the step for its job: finished (reason, trigger) or rewound."""

    reason: FinishReason | None = None
    trigger: int | str | None = None
    rewind_to: int | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[int, RequestState] = {}

    def add(self, sequence: Sequence, stop_token_ids: frozenset[int], healed: int | None) -> RequestState:
        """Start a job's text (healed: the prompt token token healing took off, if any)."""
        job = sequence.job
        state = RequestState(
            job=job,
            stop_token_ids=stop_token_ids,
            detokenizer=self._detokenizer(job, sequence.token_ids),
            stop_matcher=StopStringMatcher(job.stop_strings) if job.stop_strings else None,
            banned_guard=BannedStringGuard(job.banned_strings) if job.banned_strings else None,
            prompt_logprobs=[None] * len(job.input_ids) if job.prompt_logprobs is not None else None,
        )
        if healed is not None:
            context = self._detokenizer(job, sequence.token_ids)
            state.heal_prefix = context.add([healed]) + context.flush()
            state.heal_pending = len(state.heal_prefix)
        self.states[sequence.serial] = state
        return state

    def count_drafts(self, serial: int, drafted: int, kept: int) -> None:
        """A step verified `drafted` draft tokens of the job and kept `kept` (reported in its final result)."""
        state = self.states[serial]
        state.accepted_draft_tokens += kept
        state.rejected_draft_tokens += drafted - kept

    def score_prompts(self, scored: dict[int, tuple[int, list[TokenLogprob]]], done: Seq[Sequence]) -> None:
        """The prompt log-probabilities a step's prefill chunks scored (serial -> the position of
        the first, entries; a chunk computed again after a preemption rewrites the same values);
        the prompts in done (their last chunk ran) are scored whole (no longer kept from the prefix
        cache)."""
        for serial, (first, entries) in scored.items():
            state = self.states.get(serial)
            if state is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs[first : first + len(entries)] = entries
        for sequence in done:
            sequence.prompt_scored = True

    def _detokenizer(self, job: Job, token_ids: Seq[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, [t for t in token_ids if t not in job.embedding_rows],
                                      skip_special_tokens=not job.decode_special_tokens)

    # -- the step's text ----------------------------------------------------------

    def process(self, appended: Seq[StepTokens], now: float) -> ProcessedStep:
        """The text and results of the tokens the step appended; a stop string, stop token,
        max_new_tokens or a complete grammar finishes a job, a banned string rewinds it."""
        step = ProcessedStep()
        states = self.states
        for entry in appended:
            state = states.get(entry.sequence.serial)
            if state is not None:
                result = self._streamed(entry, state, now, step) or self._emit(entry, state, now, step)
                if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                    result.prompt_logprobs = state.prompt_logprobs  # the first result after the prefill
                    state.prompt_logprobs_sent = True
                step.outputs.append(result)
        return step

    def _streamed(self, entry: StepTokens, state: RequestState, now: float, step: ProcessedStep
                  ) -> EngineOutput | None:
        """_emit's result for the common case, one token that is not a stop token, below max_new_tokens,
        of a job without logprobs, banned strings, healing text or a grammar end (None otherwise,
        before anything changed): its text through the stop strings alone, without the general
        path's per-token records."""
        tokens, job = entry.tokens, state.job
        if (len(tokens) != 1 or entry.constraint_complete or state.banned_guard is not None or state.heal_pending
                or job.logprobs or state.constraint_done_at is not None):
            return None
        sequence = entry.sequence
        token = tokens[0]
        generated = len(sequence.token_ids) - sequence.num_prompt_tokens
        if generated >= job.max_new_tokens or token in state.stop_token_ids:
            return None
        if sequence.time_first_token is None:
            sequence.time_first_token = now
        text = state.detokenizer.add(tokens)
        if state.stop_matcher is not None:
            text, stop_string = state.stop_matcher.feed(text, generated >= job.min_new_tokens)
            if stop_string is not None:
                step.finished.append(Finished(sequence.serial, generated))
                state.completion.append(text)
                result = self.final(sequence, FinishReason.STOP_STRING, keep=generated, text=text, token_ids=tokens)
                result.eos_string = stop_string
                return result
        state.completion.append(text)
        return EngineOutput(job, sequence.serial, job.identifier, Stage.STREAMING, False, text, tokens)

    def _emit(self, entry: StepTokens, state: RequestState, now: float, step: ProcessedStep) -> EngineOutput:
        sequence, tokens = entry.sequence, entry.tokens
        if state.job.logprobs:
            state.logprobs.extend(entry.logprobs)
        if sequence.time_first_token is None:
            sequence.time_first_token = now
        texts: list[str] = []
        before = sequence.num_generated - len(tokens)
        if entry.constraint_complete:
            state.constraint_done_at = before + len(tokens)
        for i, token in enumerate(tokens):
            outcome = self._release_token(state, token, before + i + 1, texts)
            if outcome is None:
                continue
            if outcome.rewind_to is not None:
                state.rewinds += 1
                if state.rewinds > MAX_REWINDS:
                    step.failed.append(Failed(sequence.serial, f"banned_strings: still producing one of "
                                              f"{list(state.job.banned_strings)!r} after {MAX_REWINDS} rewinds"))
                else:
                    step.rewinds.append(Rewind(sequence.serial, outcome.rewind_to))
                return self._rewinding(sequence, state, "".join(texts), tokens, before, outcome.rewind_to)
            assert outcome.reason is not None
            keep = before + i + 1
            step.finished.append(Finished(sequence.serial, keep))
            state.completion.append("".join(texts))
            del state.logprobs[keep:]
            result = self.final(sequence, outcome.reason, keep=keep, text="".join(texts), token_ids=tokens[: i + 1])
            if isinstance(outcome.trigger, int):
                result.eos_token_id = outcome.trigger
                result.eos_token_str = self.tokenizer.decode([outcome.trigger], skip_special_tokens=False)
            elif isinstance(outcome.trigger, str):
                result.eos_string = outcome.trigger
            return result
        text = "".join(texts)
        state.completion.append(text)
        return self.output(sequence, Stage.STREAMING, text, tokens)

    def _release_token(self, state: RequestState, token: int, generated: int, texts: list[str]) -> _Outcome | None:
        """Release one appended token's text into texts (generated: the job's token count up to it);
        how it ends the job's step, if it does: a stop condition, or a banned string to rewind."""
        job = state.job
        can_stop = generated >= job.min_new_tokens
        if token in state.stop_token_ids and can_stop:
            end = self._release_end(state, generated - 1, can_stop=True)
            if end.rewind_to is not None:
                return _Outcome(rewind_to=end.rewind_to)
            texts.append(end.text)
            return _Outcome(FinishReason.STOP_TOKEN, token)
        detokenizer = state.detokenizer
        if state.banned_guard is None and not state.heal_pending:  # the text goes to the stop matcher alone
            released = _Released(*_match_stops(state, detokenizer.add((token,)), can_stop))
        else:
            origin = generated - 1 - detokenizer.num_held
            text = detokenizer.add((token,))
            released = self._release(state, text, can_stop, origin, generated - detokenizer.num_held)
        if released.rewind_to is not None:
            return _Outcome(rewind_to=released.rewind_to)
        texts.append(released.text)
        if released.stop_string is not None:
            return _Outcome(FinishReason.STOP_STRING, released.stop_string)
        if generated == state.constraint_done_at or generated >= job.max_new_tokens:
            grammar_end = generated == state.constraint_done_at
            end = self._release_end(state, generated, can_stop=can_stop and not grammar_end)
            if end.rewind_to is not None:
                return _Outcome(rewind_to=end.rewind_to)
            texts.append(end.text)
            if grammar_end:
                return _Outcome(FinishReason.CONSTRAINT_COMPLETE)
            if end.stop_string is not None:
                return _Outcome(FinishReason.STOP_STRING, end.stop_string)
            return _Outcome(FinishReason.MAX_NEW_TOKENS)
        return None

    def _release_end(self, state: RequestState, generated: int, can_stop: bool) -> _Released:
        """Generation ends after `generated` tokens: release all that is held (detokenizer,
        banned-string guard, stop matcher); a stop string the held text completes still counts
        when can_stop."""
        detokenizer = state.detokenizer
        origin = generated - detokenizer.num_held
        released = self._release(state, detokenizer.flush(), can_stop, origin, generated)
        if released.rewind_to is not None:
            return released
        text, stop_string = released.text, released.stop_string
        if stop_string is None and state.banned_guard is not None:
            held, stop_string = _match_stops(state, state.banned_guard.flush(), can_stop)
            text += held
        if stop_string is None and state.stop_matcher is not None:
            text += state.stop_matcher.flush()
        return _Released(text, stop_string)

    @staticmethod
    def _release(state: RequestState, text: str, can_stop: bool, origin: int, sealed: int) -> _Released:
        """Pass detokenized text (from generated token `origin` on; tokens before `sealed` give no
        more) through token healing's prefix, the banned-string guard, then the stop-string matcher."""
        if state.heal_pending and text:
            dropped = min(state.heal_pending, len(text))
            text, state.heal_pending = text[dropped:], state.heal_pending - dropped
        guard = state.banned_guard
        if guard is not None:
            text, rewind_to = guard.feed(text, origin, sealed)
            if rewind_to is not None:
                return _Released("", rewind_to=rewind_to)
        return _Released(*_match_stops(state, text, can_stop))

    def _rewinding(self, sequence: Sequence, state: RequestState, text: str, tokens: list[int], before: int,
                   origin: int) -> EngineOutput:
        """The streaming result of a step whose text completed a banned string: the text released
        before it and the step's tokens that stay; the rewind itself happens after the step."""
        state.completion.append(text)
        kept = tokens[: max(0, origin - before)]
        result = self.output(sequence, Stage.STREAMING, text, kept)
        if state.job.logprobs:
            result.logprobs = state.logprobs[before : before + len(kept)]
        return result

    def rewind(self, sequence: Sequence, origin: int) -> None:
        """Take a job's text back to generated token `origin` (the sequence is already cut there)."""
        state = self.states[sequence.serial]
        del state.logprobs[origin:]
        if state.banned_guard is not None:
            state.banned_guard.rewind(origin)
        if origin == 0:
            state.heal_pending = len(state.heal_prefix)
        state.detokenizer = self._detokenizer(state.job, sequence.token_ids)

    # -- results ------------------------------------------------------------------

    def output(self, sequence: Sequence, stage: Stage, text: str = "", token_ids: list[int] | None = None
               ) -> EngineOutput:
        """A result that is not the job's last."""
        token_ids = token_ids or []
        job = sequence.job
        logprobs = None
        if job.logprobs:
            logprobs = _tail(self.states[sequence.serial].logprobs, len(token_ids))
        return EngineOutput(job, sequence.serial, job.identifier, stage, False, text, token_ids, logprobs)

    def prefill_progress(self, sequence: Sequence) -> EngineOutput:
        """exllamav2's prefill stage: how far a prompt computed in chunks has got."""
        result = self.output(sequence, Stage.PREFILL)
        result.curr_progress = min(sequence.num_computed, sequence.num_prompt_tokens)
        result.max_progress = sequence.num_prompt_tokens
        return result

    def final(self, sequence: Sequence, reason: FinishReason, keep: int | None = None, text: str = "",
              token_ids: list[int] | None = None, error: str | None = None) -> EngineOutput:
        """The job's last result (its state leaves with it): keep is how many generated tokens
        stay (all by default)."""
        state = self.states.pop(sequence.serial)
        token_ids = token_ids or []
        outputs = sequence.output_ids if keep is None else sequence.output_ids[:keep]
        now = time.monotonic()
        started = sequence.time_started if sequence.time_started is not None else now
        first = sequence.time_first_token if sequence.time_first_token is not None else now
        job = state.job
        return EngineOutput(
            job, sequence.serial, job.identifier, Stage.EOS, True, text, token_ids,
            logprobs=_tail(state.logprobs, len(token_ids)) if job.logprobs else None,
            eos_reason=reason,
            error=error,
            full_completion="".join(state.completion),
            completion_ids=list(outputs),
            completion_logprobs=list(state.logprobs) if job.logprobs else None,
            prompt_logprobs=state.prompt_logprobs if sequence.prompt_scored else None,
            new_tokens=len(outputs),
            prompt_tokens=sequence.num_prompt_tokens,
            cached_tokens=sequence.cached_tokens,
            accepted_draft_tokens=state.accepted_draft_tokens,
            rejected_draft_tokens=state.rejected_draft_tokens,
            time_enqueued=started - sequence.time_enqueued,
            time_prefill=first - started,
            time_generate=now - first,
        )


def _match_stops(state: RequestState, text: str, can_stop: bool) -> tuple[str, str | None]:
    if state.stop_matcher is None:
        return text, None
    return state.stop_matcher.feed(text, can_stop)


def _tail(logprobs: list[TokenLogprob], count: int) -> list[TokenLogprob]:
    """The logprobs of a result's tokens (the last ones appended)."""
    return logprobs[len(logprobs) - count:] if count else []
