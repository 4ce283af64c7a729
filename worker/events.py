"""Engine outputs -> wire events, choices and results: the one place that turns
what Generator.iterate() reports (engine.outputs) into what producers read
(producer.protocol). Pure: no threads, no Redis, no generator; the engine
loop feeds it each step's outputs and publishes what it returns.

A request's end comes in two parts: conclude() decides it on the engine loop
(reasons, counts, the final event's seq: cheap), finish() builds the final
event and the result from that off the loop, since a result's logprobs (a
token and its top alternatives, each with its text) can be a million values;
it calls the pace it is given after each token's, so that the thread building
them can leave the loop the GIL (worker/pacing.py)."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import EngineOutput, FinishReason, Stage
from engine.outputs import TokenLogprob as EngineTokenLogprob
from producer.protocol import (
    Choice,
    EventType,
    GenerationRequest,
    GenerationResult,
    StreamEvent,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from producer.protocol import FinishReason as WireFinishReason
from worker.coalescing import Coalescing, PendingChunk, PromptScores
from worker.pacing import Pace, no_pace
from worker.tool_results import with_reasoning, with_tool_calls

EOS_REASON_TO_FINISH_REASON: dict[FinishReason, WireFinishReason] = {
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.CONSTRAINT_COMPLETE: "stop",
    FinishReason.ERROR: "error",  # a request that failed inside a step: its error event (the worker sends no result)
    FinishReason.MAX_NEW_TOKENS: "length",
    FinishReason.CANCELLED: "cancelled",
}
"""The engine's eos_reason values and the finish_reason each one is reported as."""


def finish_reason_from_eos(eos_reason: str) -> WireFinishReason:
    """The wire finish_reason for an engine eos_reason; unknown reasons are a bug, not a default."""
    try:
        return EOS_REASON_TO_FINISH_REASON[FinishReason(eos_reason)]
    except (KeyError, ValueError):
        known = ", ".join(EOS_REASON_TO_FINISH_REASON)
        raise ValueError(f"unknown engine eos_reason {eos_reason!r} (known: {known})") from None


def sample_of(identifier: object) -> tuple[Any, int]:
    """(request identifier, sample index) of an engine output: Job.samples names its
    children (identifier, i); a lone job is sample 0."""
    if isinstance(identifier, tuple):
        return identifier[0], identifier[1]
    return identifier, 0


@dataclass(frozen=True)
class StoredResult:
    """A result as the result backend stores it: the JSON object of GenerationResult.to_dict().
    Built as that object, its logprobs as plain dicts rather than models: 64 results of 100
    tokens with 20 alternatives each are 134,000 of them, which as models took the worker
    about a second to make (and the garbage collector long pauses to walk)."""

    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.data

    @property
    def finish_reason(self) -> str:
        return str(self.data["finish_reason"])


@dataclass(frozen=True)
class Ending:
    """A request's terminal event and the result stored with it."""

    event: StreamEvent
    result: StoredResult


@dataclass(frozen=True)
class Outcome:
    """How a request ended, as the engine loop decides it once every sample has ended: what
    the loop counts and reports, and the seq its final event takes. RequestEvents.finish
    builds the event and result from it."""

    kind: EventType
    finish_reason: WireFinishReason
    usage: Usage
    timings: Timings
    expired: bool
    seq: int


@dataclass
class RequestEvents:
    """The wire side of one attempt of one request: its event counter, each sample's chunk waiting
    to go out (with `coalescing`: worker/coalescing.py) and each sample's final output until all
    `samples` have ended. token_text decodes one token id for logprobs."""

    identifier: str
    attempt: int
    request: GenerationRequest
    samples: int
    token_text: Callable[[int], str]
    seq: int = 0
    started: bool = False
    prompt_sent: bool = False
    outputs: dict[int, EngineOutput] = field(default_factory=dict)
    coalescing: Coalescing = field(default_factory=Coalescing)
    _pending: defaultdict[int, PendingChunk] = field(default_factory=lambda: defaultdict(PendingChunk), init=False)
    _last_sent: dict[int, float] = field(default_factory=dict, init=False)
    next_due: float = field(default=math.inf, init=False)
    """When the earliest pending chunk's interval passes (time.monotonic()); inf when none waits."""

    def event(self, kind: EventType, **fields: Any) -> StreamEvent:
        event = StreamEvent(id=self.identifier, seq=self.seq, attempt=self.attempt, event=kind, **fields)
        self.seq += 1
        return event

    def chunk(self, text: str, token_ids: list[int] | None, logprobs: list[TokenLogprob] | None,
              index: int, prompt: PromptScores | None = None) -> StreamEvent:
        """Sample `index`'s per-token event (the index shown only when the request has several),
        built without validation: every field comes from this worker (a checked identifier, its own
        counters, the engine's text and ids), and validating it cost more than the rest of the event's
        path. `prompt`: the prompt's token ids and log-probabilities, on the one chunk that carries them."""
        prompt_ids, prompt_logprobs = prompt if prompt is not None else (None, None)
        event = StreamEvent.model_construct(id=self.identifier, seq=self.seq, attempt=self.attempt, event="chunk",
                                            text=text, token_ids=token_ids, logprobs=logprobs,
                                            index=index if self.request.n > 1 else None,
                                            prompt_token_ids=prompt_ids, prompt_logprobs=prompt_logprobs)
        self.seq += 1
        return event

    def progress(self, index: int, output: EngineOutput, now: float | None = None) -> list[StreamEvent]:
        """The events of one sample's step output: `started` once per request (whichever sample
        starts first), then a chunk for any text, token ids or logprobs when the request streams.
        Sample 0's first output after the prefill also brings the prompt's log-probabilities (a
        request with prompt_logprobs): its chunk carries them, even with no text of its own, once
        per attempt (the engine repeats them on the final output, for the result). Coalescing, the
        piece joins the sample's pending chunk, which goes out at once when it is the sample's
        first or carries the prompt's log-probabilities, else when due (`now`: time.monotonic())."""
        if output.stage is Stage.STARTED:
            if self.started:
                return []
            self.started = True
            return [self.event("started")]
        options = self.request.stream
        if not options.enabled:
            return []
        token_ids = output.token_ids if options.include_token_ids else None
        logprobs = self.wire_logprobs(output.logprobs) if output.logprobs else None
        prompt = None
        if output.prompt_logprobs is not None and index == 0 and not self.prompt_sent:
            self.prompt_sent = True
            prompt = (list(output.job.input_ids), self.wire_prompt_logprobs(output.prompt_logprobs))
        piece = bool(output.text or token_ids or logprobs or prompt)
        if not self.coalescing.enabled:
            return [self.chunk(output.text, token_ids, logprobs, index, prompt)] if piece else []
        if not (piece or output.token_ids):
            return []
        # A step whose text is held back (a stop string's possible start, half a character) still
        # counts its tokens towards coalesce_tokens.
        pending = self._pending[index]
        pending.add(output.text, token_ids, logprobs, len(output.token_ids), prompt)
        if pending.empty:
            return []
        now = time.monotonic() if now is None else now
        last_sent = self._last_sent.get(index)
        if last_sent is None or prompt is not None or self.coalescing.due(pending, last_sent, now):
            return [self._send(index, now)]
        if self.coalescing.interval_s > 0:
            self.next_due = min(self.next_due, last_sent + self.coalescing.interval_s)
        return []

    @property
    def pending(self) -> bool:
        """Whether some sample has a chunk waiting to go out."""
        return any(not pending.empty for pending in self._pending.values())

    def due(self, now: float) -> list[StreamEvent]:
        """The pending chunks whose interval has passed, for samples that produced nothing since
        (a preempted or waiting sample): progress() sends the others' as they grow. The loop
        asks only once `next_due` has passed, one comparison per request and step."""
        return [self._send(index, now) for index, pending in list(self._pending.items())
                if not pending.empty and self.coalescing.due(pending, self._last_sent[index], now)]

    def flush(self, index: int | None = None) -> list[StreamEvent]:
        """Sample `index`'s pending chunk, or every sample's: a sample or the request is ending, and
        its final event (or error) must follow all its text."""
        now = time.monotonic()
        indices = sorted(self._pending) if index is None else [index] if index in self._pending else []
        events = []
        for i in indices:
            if self._pending[i].empty:  # tokens whose text never came: nothing to send
                del self._pending[i]
            else:
                events.append(self._send(i, now))
        return events

    def _send(self, index: int, now: float) -> StreamEvent:
        pending = self._pending.pop(index)
        self._last_sent[index] = now
        if self.coalescing.interval_s > 0:
            self.next_due = min((self._last_sent[i] + self.coalescing.interval_s
                                 for i, waiting in self._pending.items() if not waiting.empty), default=math.inf)
        return self.chunk(pending.text, pending.token_ids, pending.logprobs, index, pending.prompt)

    def record(self, index: int, output: EngineOutput) -> bool:
        """Keep a sample's final output; True once every sample has ended."""
        self.outputs[index] = output
        return len(self.outputs) >= self.samples

    def error(self, message: str) -> StreamEvent:
        return self.event("error", finish_reason="error", error=message)

    def cancelled(self, prompt_tokens: int) -> Ending:
        """A request cancelled before it reached the engine: empty text, every sample cancelled."""
        choices = [Choice(index=i, text="", finish_reason="cancelled") for i in range(self.request.n)]
        result = self._result(choices, "cancelled", Usage(prompt_tokens=prompt_tokens), Timings())
        return Ending(self.event("cancelled", finish_reason="cancelled"), StoredResult(result))

    def conclude(self, expired: bool) -> Outcome:
        """How the request ended once every sample has (record() said so); takes the final
        event's seq. A request its deadline cut ends in "deadline"; one whose sample was
        cancelled, "cancelled"; otherwise it ends as sample 0 did."""
        outputs = [self.outputs[i] for i in range(self.samples)]
        if expired:
            finish_reason: WireFinishReason = "deadline"
            kind: EventType = "done"
        elif any(output.eos_reason is FinishReason.CANCELLED for output in outputs):
            finish_reason, kind = "cancelled", "cancelled"
        else:
            finish_reason, kind = _sample_finish_reason(outputs[0], expired), "done"
        first = outputs[0]
        # The engine sets the counts and timings on every final (eos) output.
        assert first.prompt_tokens is not None and first.cached_tokens is not None
        assert first.time_enqueued is not None and first.time_prefill is not None
        usage = Usage(
            prompt_tokens=first.prompt_tokens,
            completion_tokens=sum(output.new_tokens or 0 for output in outputs),
            cached_tokens=first.cached_tokens,
        )
        timings = Timings(queued_s=first.time_enqueued, prefill_s=first.time_prefill,
                          generate_s=max(output.time_generate or 0.0 for output in outputs))
        seq, self.seq = self.seq, self.seq + 1
        return Outcome(kind, finish_reason, usage, timings, expired, seq)

    def finish(self, outcome: Outcome, pace: Pace = no_pace) -> Ending:
        """The final event and the result of a concluded request. The result holds every
        logprob, the prompt's too; the event holds none (each chunk carried its tokens' logprobs),
        so a request's logprobs are not stored once more in its replay stream. pace() is called
        after each token's logprobs."""
        outputs = [self.outputs[i] for i in range(self.samples)]
        choices = with_tool_calls(with_reasoning([Choice(index=i, text=output.full_completion or "",
                                                         token_ids=output.completion_ids or [],
                                                         finish_reason=_sample_finish_reason(output, outcome.expired))
                                                  for i, output in enumerate(outputs)], self.request),
                                  self.request, self.identifier)
        finish_reason = ("tool_calls" if outcome.finish_reason == "stop" and choices[0].finish_reason == "tool_calls"
                         else outcome.finish_reason)
        include_ids = self.request.stream.include_token_ids
        many = self.request.n > 1
        event = StreamEvent(
            id=self.identifier,
            seq=outcome.seq,
            attempt=self.attempt,
            event=outcome.kind,
            text=choices[0].text,
            token_ids=choices[0].token_ids if include_ids else None,
            finish_reason=finish_reason,
            usage=outcome.usage,
            timings=outcome.timings,
            choices=[c if include_ids else c.model_copy(update={"token_ids": None}) for c in choices]
            if many else None,
        )
        result = self._result(choices, finish_reason, outcome.usage, outcome.timings)
        logprobs = [self.logprob_dicts(output.completion_logprobs, pace) if output.completion_logprobs is not None
                    else None for output in outputs]
        result["logprobs"] = logprobs[0]
        for choice in result["choices"] or []:
            choice["logprobs"] = logprobs[choice["index"]]
        scored = outputs[0].prompt_logprobs  # the samples' one prompt, scored by sample 0 (Job.samples)
        if scored is not None:
            result["prompt_token_ids"] = list(outputs[0].job.input_ids)
            result["prompt_logprobs"] = [None if lp is None else self.logprob_dict(lp, pace) for lp in scored]
        return Ending(event, StoredResult(result))

    def _result(self, choices: list[Choice], finish_reason: WireFinishReason, usage: Usage, timings: Timings
                ) -> dict[str, Any]:
        """The result's JSON object: choice 0's text and parts at the top, every choice when n > 1."""
        first = choices[0]
        return GenerationResult(
            id=self.identifier,
            attempt=self.attempt,
            text=first.text,
            token_ids=first.token_ids or [],
            finish_reason=finish_reason,
            usage=usage,
            timings=timings,
            metadata=self.request.metadata,
            choices=choices if self.request.n > 1 else None,
            content=first.content,
            tool_calls=first.tool_calls,
            reasoning_content=first.reasoning_content,
        ).to_dict()

    def wire_logprobs(self, logprobs: list[EngineTokenLogprob]) -> list[TokenLogprob]:
        """The engine's logprobs with each token's text, built without re-validation (as chunk())."""
        decode = self.token_text
        return [
            TokenLogprob.model_construct(
                token_id=lp.token_id, token=decode(lp.token_id), logprob=lp.logprob,
                top_logprobs=[TopLogprob.model_construct(token_id=t, token=decode(t), logprob=v) for t, v in lp.top])
            for lp in logprobs
        ]

    def wire_prompt_logprobs(self, scored: list[EngineTokenLogprob | None]) -> list[TokenLogprob | None]:
        """The prompt's log-probabilities as wire_logprobs makes a chunk's; the first is None."""
        return [None if lp is None else self.wire_logprobs([lp])[0] for lp in scored]

    def logprob_dicts(self, logprobs: list[EngineTokenLogprob], pace: Pace = no_pace) -> list[dict[str, Any]]:
        """wire_logprobs as the JSON objects a result stores (see StoredResult)."""
        return [self.logprob_dict(lp, pace) for lp in logprobs]

    def logprob_dict(self, lp: EngineTokenLogprob, pace: Pace = no_pace) -> dict[str, Any]:
        """One logprob as the JSON object a result stores; pace() once it is made."""
        decode = self.token_text
        made = {"token_id": lp.token_id, "token": decode(lp.token_id), "logprob": lp.logprob,
                "top_logprobs": [{"token_id": t, "token": decode(t), "logprob": v} for t, v in lp.top]}
        pace()
        return made


def _sample_finish_reason(output: EngineOutput, expired: bool) -> WireFinishReason:
    """A sample's finish_reason; a sample the deadline cut ends in "deadline"."""
    if output.eos_reason is FinishReason.CANCELLED and expired:
        return "deadline"
    return finish_reason_from_eos(output.eos_reason or "")
