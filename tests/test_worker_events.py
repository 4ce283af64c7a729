"""worker/events.py: engine outputs -> wire events, choices and results, checked
field by field on hand-made EngineOutput records (no threads, no Redis, no model)."""

from __future__ import annotations

from typing import Any

import pytest

from engine import EngineOutput, FinishReason, Job, Stage
from engine.outputs import TokenLogprob as EngineTokenLogprob
from producer.protocol import (
    Choice,
    GenerationRequest,
    GenerationResult,
    StreamEvent,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from worker import events
from worker.events import RequestEvents, finish_reason_from_eos, sample_of

JOB = Job([1, 2, 3], 8, identifier="r1")


def stream(n: int = 1, **request: Any) -> RequestEvents:
    parsed = GenerationRequest.parse_payload({"prompt": "x", "n": n, "metadata": {"k": "v"}, **request})
    return RequestEvents("r1", 2, parsed, n, token_text=lambda t: f"<{t}>")


def output(stage: Stage, text: str = "", token_ids: list[int] | None = None, **fields: Any) -> EngineOutput:
    return EngineOutput(job=JOB, serial=0, identifier="r1", stage=stage, eos=stage is Stage.EOS, text=text,
                        token_ids=token_ids or [], **fields)


def finish(wire: RequestEvents, expired: bool = False) -> tuple[StreamEvent, GenerationResult]:
    """conclude() then finish(), as the loop and the finishing thread call them; the result read
    back from the JSON object the backend stores."""
    ending = wire.finish(wire.conclude(expired))
    return ending.event, GenerationResult.from_dict(ending.result.to_dict())


def final(text: str, ids: list[int], reason: FinishReason, **fields: Any) -> EngineOutput:
    values: dict[str, Any] = {"new_tokens": len(ids), "prompt_tokens": 3, "cached_tokens": 1, "time_enqueued": 0.5,
                              "time_prefill": 0.25, "time_generate": 1.0, **fields}
    return output(Stage.EOS, eos_reason=reason, full_completion=text, completion_ids=ids, **values)


# --- the finish-reason map ----------------------------------------------------


def test_finish_reasons_map_from_the_engine_eos_reasons():
    assert finish_reason_from_eos("stop_token") == "stop"
    assert finish_reason_from_eos("stop_string") == "stop"
    assert finish_reason_from_eos("max_new_tokens") == "length"
    assert finish_reason_from_eos("cancelled") == "cancelled"
    assert finish_reason_from_eos(FinishReason.CONSTRAINT_COMPLETE) == "stop"
    with pytest.raises(ValueError, match="unknown engine eos_reason 'banana'"):
        finish_reason_from_eos("banana")


def test_the_mapping_covers_every_eos_reason_the_engine_produces():
    produced = set(FinishReason)
    assert produced and produced <= set(events.EOS_REASON_TO_FINISH_REASON), (
        produced - set(events.EOS_REASON_TO_FINISH_REASON))


def test_sample_of_reads_job_samples_identifiers():
    assert sample_of("r1") == ("r1", 0)
    assert [sample_of(child.identifier) for child in JOB.samples(2)] == [("r1", 0), ("r1", 1)]


# --- step events --------------------------------------------------------------


def test_started_once_then_chunks_with_contiguous_seq():
    wire = stream()
    started = wire.progress(0, output(Stage.STARTED))
    assert [(e.event, e.id, e.seq, e.attempt) for e in started] == [("started", "r1", 0, 2)]
    assert wire.progress(0, output(Stage.STARTED)) == []
    assert wire.progress(0, output(Stage.PREFILL, curr_progress=2, max_progress=3)) == []
    (chunk,) = wire.progress(0, output(Stage.STREAMING, "Hel", [7]))
    assert (chunk.event, chunk.seq, chunk.text, chunk.token_ids, chunk.logprobs, chunk.index) == (
        "chunk", 1, "Hel", None, None, None)
    assert wire.progress(0, output(Stage.STREAMING, "", [8])) == []  # no text, ids not asked for


def test_chunks_carry_token_ids_and_logprobs_when_asked():
    wire = stream(stream={"include_token_ids": True}, logprobs=True, top_logprobs=1)
    lp = EngineTokenLogprob(token_id=8, logprob=-0.5, top=((8, -0.5), (9, -1.5)))
    (chunk,) = wire.progress(0, output(Stage.STREAMING, "", [8], logprobs=[lp]))
    assert chunk.text == "" and chunk.token_ids == [8]
    assert chunk.logprobs == [TokenLogprob(token_id=8, token="<8>", logprob=-0.5, top_logprobs=[
        TopLogprob(token_id=8, token="<8>", logprob=-0.5), TopLogprob(token_id=9, token="<9>", logprob=-1.5)])]


def test_a_request_that_does_not_stream_gets_no_chunks():
    wire = stream(stream={"enabled": False})
    assert [e.event for e in wire.progress(0, output(Stage.STARTED))] == ["started"]
    assert wire.progress(0, output(Stage.STREAMING, "text", [5])) == []


def test_samples_chunks_name_their_index():
    wire = stream(n=2)
    (chunk,) = wire.progress(1, output(Stage.STREAMING, "b", [5]))
    assert chunk.index == 1


def prompt_scores() -> list[EngineTokenLogprob | None]:
    """What the engine reports for JOB's prompt [1, 2, 3] with prompt_logprobs=1: the first token none."""
    return [None, EngineTokenLogprob(token_id=2, logprob=-1.5, top=((4, -0.5),)),
            EngineTokenLogprob(token_id=3, logprob=-0.25, top=((3, -0.25),))]


def test_exactly_one_chunk_carries_the_prompt_logprobs_even_without_text():
    wire = stream(prompt_logprobs=1)
    wire.progress(0, output(Stage.STARTED))
    scored = prompt_scores()
    (first,) = wire.progress(0, output(Stage.STREAMING, "", [8], prompt_logprobs=scored))  # text held back
    later = wire.progress(0, output(Stage.STREAMING, "Hi", [9]))
    wire.record(0, final("Hi", [8, 9], FinishReason.MAX_NEW_TOKENS, prompt_logprobs=scored))  # the engine repeats them
    event, result = finish(wire)
    assert (first.event, first.text, first.index, first.prompt_token_ids) == ("chunk", "", None, [1, 2, 3])
    second = TokenLogprob(token_id=2, token="<2>", logprob=-1.5,
                          top_logprobs=[TopLogprob(token_id=4, token="<4>", logprob=-0.5)])
    third = TokenLogprob(token_id=3, token="<3>", logprob=-0.25,
                         top_logprobs=[TopLogprob(token_id=3, token="<3>", logprob=-0.25)])
    assert first.prompt_logprobs == [None, second, third]
    assert first.prompt_logprobs == result.prompt_logprobs and first.prompt_token_ids == result.prompt_token_ids
    assert [e.prompt_logprobs for e in [*later, event]] == [None, None]
    assert StreamEvent.from_json(first.to_json()) == first  # the unvalidated chunk obeys the event rules


def test_the_prompt_logprobs_ride_on_sample_0_s_chunk_and_again_on_a_new_attempt():
    for attempt in (1, 2):
        wire = RequestEvents("r1", attempt, GenerationRequest.parse_payload(
            {"prompt": "x", "n": 2, "prompt_logprobs": 0}), 2, token_text=lambda t: f"<{t}>")
        (other,) = wire.progress(1, output(Stage.STREAMING, "b", [5]))
        (first,) = wire.progress(0, output(Stage.STREAMING, "a", [6], prompt_logprobs=prompt_scores()))
        assert other.prompt_logprobs is None
        assert (first.index, first.attempt, first.prompt_token_ids) == (0, attempt, [1, 2, 3])


def test_a_request_that_does_not_stream_leaves_its_prompt_logprobs_to_the_result():
    wire = stream(stream={"enabled": False}, prompt_logprobs=0)
    assert wire.progress(0, output(Stage.STREAMING, "", [8], prompt_logprobs=prompt_scores())) == []


# --- endings ------------------------------------------------------------------


def test_a_finished_request_s_event_and_result():
    wire = stream(stream={"include_token_ids": True})
    wire.progress(0, output(Stage.STARTED))
    assert wire.record(0, final("Hello", [7, 8], FinishReason.STOP_TOKEN))
    event, result = finish(wire)
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    timings = Timings(queued_s=0.5, prefill_s=0.25, generate_s=1.0)
    assert (event.event, event.seq, event.attempt, event.text, event.token_ids, event.finish_reason) == (
        "done", 1, 2, "Hello", [7, 8], "stop")
    assert (event.usage, event.timings, event.choices, event.error) == (usage, timings, None, None)
    assert (result.id, result.attempt, result.text, result.token_ids, result.finish_reason) == (
        "r1", 2, "Hello", [7, 8], "stop")
    assert (result.usage, result.timings, result.metadata, result.choices, result.logprobs) == (
        usage, timings, {"k": "v"}, None, None)


def test_the_final_event_leaves_token_ids_out_unless_asked_but_the_result_keeps_them():
    wire = stream()
    wire.record(0, final("Hi", [7], FinishReason.MAX_NEW_TOKENS))
    event, result = finish(wire)
    assert event.token_ids is None and result.token_ids == [7]
    assert result.finish_reason == "length"


def test_n_samples_end_together_with_a_choice_each():
    wire = stream(n=2)
    assert not wire.record(1, final("b", [9, 9, 9], FinishReason.MAX_NEW_TOKENS, time_generate=2.0))
    assert wire.record(0, final("a", [7], FinishReason.STOP_STRING))
    event, result = finish(wire)
    choices = [Choice(index=0, text="a", token_ids=[7], finish_reason="stop"),
               Choice(index=1, text="b", token_ids=[9, 9, 9], finish_reason="length")]
    assert result.choices == choices
    assert event.choices == [c.model_copy(update={"token_ids": None}) for c in choices]
    assert (result.text, result.finish_reason) == ("a", "stop")
    assert result.usage == Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=1)
    assert result.timings.generate_s == 2.0


def test_a_cancelled_sample_cancels_the_request():
    wire = stream(n=2)
    wire.record(0, final("a", [7], FinishReason.STOP_TOKEN))
    wire.record(1, final("b", [8], FinishReason.CANCELLED))
    event, result = finish(wire)
    assert (event.event, event.finish_reason, result.finish_reason) == ("cancelled", "cancelled", "cancelled")
    assert [c.finish_reason for c in result.choices or []] == ["stop", "cancelled"]


def test_a_deadline_ends_done_with_the_text_so_far():
    wire = stream(n=2)
    wire.record(0, final("a", [7], FinishReason.CANCELLED))
    wire.record(1, final("b", [8], FinishReason.STOP_TOKEN))
    event, result = finish(wire, expired=True)
    assert (event.event, event.finish_reason, event.text) == ("done", "deadline", "a")
    assert [c.finish_reason for c in result.choices or []] == ["deadline", "stop"]


def test_completion_logprobs_reach_the_result_and_not_the_final_event():
    wire = stream(logprobs=True, top_logprobs=2)
    lp = EngineTokenLogprob(token_id=7, logprob=-0.25, top=[(7, -0.25), (9, -2.5)])
    wire.record(0, final("a", [7], FinishReason.STOP_TOKEN, completion_logprobs=[lp]))
    event, result = finish(wire)
    expected = [TokenLogprob(token_id=7, token="<7>", logprob=-0.25, top_logprobs=[
        TopLogprob(token_id=7, token="<7>", logprob=-0.25), TopLogprob(token_id=9, token="<9>", logprob=-2.5)])]
    assert result.logprobs == expected and event.logprobs is None


def test_each_sample_s_logprobs_reach_its_choice_and_the_result_dict_is_what_the_model_dumps():
    wire = stream(n=2, logprobs=True)
    for index, token in enumerate([7, 9]):
        lp = EngineTokenLogprob(token_id=token, logprob=-1.0 - index)
        wire.record(index, final(f"<{token}>", [token], FinishReason.STOP_TOKEN, completion_logprobs=[lp]))
    ending = wire.finish(wire.conclude(expired=False))
    stored = ending.result.to_dict()
    result = GenerationResult.from_dict(stored)
    assert stored == result.to_dict()  # the hand-built logprob dicts have the models' shape
    assert [c.logprobs for c in result.choices or []] == [
        [TokenLogprob(token_id=7, token="<7>", logprob=-1.0)], [TokenLogprob(token_id=9, token="<9>", logprob=-2.0)]]
    assert result.choices is not None and result.logprobs == result.choices[0].logprobs
    assert all(c.logprobs is None for c in ending.event.choices or [])


def test_conclude_takes_the_final_event_s_seq_so_later_events_follow_it():
    wire = stream()
    wire.progress(0, output(Stage.STARTED))
    wire.record(0, final("a", [7], FinishReason.STOP_TOKEN))
    outcome = wire.conclude(expired=False)
    assert (outcome.seq, wire.seq, outcome.kind, outcome.finish_reason) == (1, 2, "done", "stop")
    assert wire.finish(outcome).event.seq == 1


def test_cancelled_before_start():
    ending = stream(n=3).cancelled(prompt_tokens=5)
    assert (ending.event.event, ending.event.seq, ending.event.finish_reason, ending.event.text) == (
        "cancelled", 0, "cancelled", "")
    result = GenerationResult.from_dict(ending.result.to_dict())
    assert (result.text, result.finish_reason, result.usage, result.timings, result.metadata) == (
        "", "cancelled", Usage(prompt_tokens=5), Timings(), {"k": "v"})
    assert result.choices == [Choice(index=i, text="", finish_reason="cancelled") for i in range(3)]
    assert stream().cancelled(prompt_tokens=1).result.to_dict()["choices"] is None


def test_an_error_event():
    wire = stream()
    wire.progress(0, output(Stage.STARTED))
    event = wire.error("engine error: boom")
    assert (event.event, event.seq, event.finish_reason, event.error) == ("error", 1, "error", "engine error: boom")
