"""Chunk coalescing in worker/events.py, step by step on hand-made engine outputs with explicit
clock readings (no threads, no Redis, no model): what a merged chunk carries, and when it goes out.
tests/test_coalescing.py runs the same through a real worker."""

from __future__ import annotations

from typing import Any

import pytest

from engine import EngineOutput, Job, Stage
from engine.outputs import TokenLogprob as EngineTokenLogprob
from producer.protocol import GenerationRequest, ProtocolError
from worker.coalescing import Coalescing
from worker.events import RequestEvents

JOB = Job([1, 2, 3], 8, identifier="r1")


def stream(worker_default: Coalescing, n: int = 1, prompt_logprobs: int | None = None, **options: Any
           ) -> RequestEvents:
    request = GenerationRequest.parse_payload({"prompt": "x", "n": n, "logprobs": True, "top_logprobs": 1,
                                               "prompt_logprobs": prompt_logprobs,
                                               "stream": {"include_token_ids": True, **options}})
    wire = RequestEvents("r1", 1, request, n, token_text=lambda t: f"<{t}>",
                         coalescing=worker_default.for_request(request.stream))
    wire.progress(0, output(Stage.STARTED))
    return wire


def output(stage: Stage, text: str = "", token_ids: list[int] | None = None, **fields: Any) -> EngineOutput:
    ids = token_ids or []
    return EngineOutput(job=JOB, serial=0, identifier="r1", stage=stage, eos=stage is Stage.EOS, text=text,
                        token_ids=ids, logprobs=[EngineTokenLogprob(t, -0.5, [(t, -0.5)]) for t in ids] or None,
                        **fields)


def test_a_request_s_own_values_win_field_by_field_over_the_worker_default():
    default = Coalescing.of(200, 5)
    assert stream(default).coalescing == Coalescing(0.2, 5)
    assert stream(default, coalesce_ms=0).coalescing == Coalescing(0.0, 5)
    assert stream(default, coalesce_tokens=0).coalescing == Coalescing(0.2, 0)
    assert not stream(Coalescing()).coalescing.enabled


def test_pieces_merge_in_order_after_the_first_chunk_which_goes_out_at_once():
    wire = stream(Coalescing.of(20, 0))
    (first,) = wire.progress(0, output(Stage.STREAMING, "Hel", [7]), now=1.0)
    assert (first.seq, first.text, first.token_ids) == (1, "Hel", [7])
    assert wire.progress(0, output(Stage.STREAMING, "lo", [8]), now=1.005) == []
    assert wire.progress(0, output(Stage.STREAMING, "", [9]), now=1.010) == []  # held-back text: ids only
    (merged,) = wire.progress(0, output(Stage.STREAMING, " you", [10]), now=1.020)
    assert (merged.seq, merged.text, merged.token_ids) == (2, "lo you", [8, 9, 10])
    assert merged.logprobs is not None and [lp.token for lp in merged.logprobs] == ["<8>", "<9>", "<10>"]
    assert not wire.pending


def test_a_sample_that_produced_nothing_since_gets_its_pending_chunk_once_the_interval_passed():
    wire = stream(Coalescing.of(20, 0))
    wire.progress(0, output(Stage.STREAMING, "a", [5]), now=1.0)
    assert wire.progress(0, output(Stage.STREAMING, "b", [6]), now=1.001) == []
    assert wire.pending and wire.next_due == pytest.approx(1.020) and wire.due(now=1.019) == []
    (late,) = wire.due(now=1.021)
    assert (late.text, late.token_ids) == ("b", [6]) and not wire.pending and wire.next_due == float("inf")


def test_the_token_trigger_sends_every_m_tokens_and_flush_sends_each_sample_s_rest():
    wire = stream(Coalescing.of(0, 2), n=2)
    sent = [event for step in range(4) for index in (0, 1)
            for event in wire.progress(index, output(Stage.STREAMING, f"{index}{step}", [step]))]
    assert [(e.index, e.text) for e in sent] == [(0, "00"), (1, "10"), (0, "0102"), (1, "1112")]
    rest = wire.flush()
    assert [(e.index, e.text, e.token_ids) for e in rest] == [(0, "03", [3]), (1, "13", [3])]
    assert [e.seq for e in sent + rest] == list(range(1, 7)) and wire.flush() == []


def test_the_chunk_with_the_prompt_s_logprobs_goes_out_at_once():
    wire = stream(Coalescing.of(10_000, 0), prompt_logprobs=1)
    wire.progress(0, output(Stage.STREAMING, "a", [5]), now=1.0)
    assert wire.progress(0, output(Stage.STREAMING, "b", [6]), now=1.1) == []
    scored = [None, EngineTokenLogprob(2, -1.0, [(2, -1.0)]), EngineTokenLogprob(3, -2.0, [(3, -2.0)])]
    (chunk,) = wire.progress(0, output(Stage.STREAMING, "c", [7], prompt_logprobs=scored), now=1.2)
    assert chunk.text == "bc" and chunk.prompt_token_ids == [1, 2, 3] and chunk.prompt_logprobs is not None


@pytest.mark.parametrize(("field", "value", "limit"), [("coalesce_ms", 10_001, "10000"),
                                                       ("coalesce_tokens", 1_025, "1024"),
                                                       ("coalesce_ms", -1, "0")])
def test_out_of_range_coalescing_is_refused_naming_the_field_and_the_limit(field: str, value: int, limit: str):
    with pytest.raises(ProtocolError) as refused:
        GenerationRequest.parse_payload({"prompt": "x", "stream": {field: value}})
    message = str(refused.value)
    assert message.startswith(f"stream.{field}: ") and limit in message, message


def test_tokens_whose_text_is_held_back_count_towards_the_token_trigger():
    request = GenerationRequest.parse_payload({"prompt": "x", "stream": {"coalesce_tokens": 3}})
    wire = RequestEvents("r1", 1, request, 1, token_text=str, coalescing=Coalescing().for_request(request.stream))

    def step(text: str, token: int, stage: Stage = Stage.STREAMING) -> list[str]:
        made = EngineOutput(job=JOB, serial=0, identifier="r1", stage=stage, eos=stage is Stage.EOS, text=text,
                            token_ids=[token])
        return [event.text for event in wire.progress(0, made)]

    assert step("a", 1) == ["a"]
    assert step("", 2) == [] and step("", 3) == [] and not wire.pending  # held back: nothing to send yet
    assert step("bcd", 4) == ["bcd"]  # its 3 tokens since the last chunk
    assert step("", 5) == [] and [e.text for e in wire.flush()] == []  # a held-back end sends no empty chunk
