"""worker/pacing.py: a paced encoding writes json.dumps's text exactly, and a paced job leaves a
thread that keeps giving up and taking back the GIL (as the engine loop does at every torch op)
its turn within about a slice, where one json.dumps of the same value holds it throughout.

How the GIL's hold is measured: a ticker thread sleeps 0.2 ms (the GIL released, as around a
torch op) and takes the GIL back, again and again; its longest gap between two ticks, less the
time it waited for a CPU (tests/pauses.py), is how long another thread kept the GIL from it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import serialization
from kombu.utils.json import dumps as kombu_dumps

from tests.pauses import Pause, PauseClock, frozen_heap, schedstat_path
from worker.app import PACED_JSON
from worker.pacing import PACER, SLICE_S, dumps_paced, no_pace, paced_result_json

TOKENS = 3000
"""A result's worth of logprobs, 20 alternatives a token: one json.dumps of it takes about 130 ms here."""
LONGEST_HOLD_S = 0.03
"""A paced job's bound on keeping the GIL from the ticker: its slice, one piece of encoding
and the interpreter's switch interval (5 ms), with room for this machine's noise."""


def logprobs(tokens: int) -> list[dict[str, Any]]:
    """A result's logprobs as events.RequestEvents.logprob_dicts makes them (non-ASCII text too)."""
    return [{"token_id": i, "token": f"tok\u00e9\u4e00{i}\n\"", "logprob": -i / 7,
             "top_logprobs": [{"token_id": j, "token": f"alt{j}\u2028", "logprob": -j / 3} for j in range(20)]}
            for i in range(tokens)]


def result(tokens: int) -> dict[str, Any]:
    """A GenerationResult.to_dict() with logprobs, n = 2 choices and prompt logprobs (None first)."""
    return {"id": "r", "text": "caf\u00e9", "token_ids": list(range(tokens)), "finish_reason": "length",
            "usage": {"prompt_tokens": 3, "completion_tokens": tokens}, "metadata": {}, "tool_calls": None,
            "logprobs": logprobs(tokens), "prompt_logprobs": [None, *logprobs(3)], "empty": [], "pair": (1, 2.5),
            "choices": [{"index": i, "text": "", "logprobs": logprobs(tokens // 2)} for i in range(2)],
            "int_keys": {1: "json.dumps makes this key a string"}}


@pytest.mark.parametrize("encode", [json.dumps, kombu_dumps])
def test_a_paced_encoding_is_the_same_text(encode: Callable[[Any], str]):
    value = result(300)
    assert dumps_paced(value, no_pace, encode) == encode(value)


def test_the_result_serializer_is_kombu_json_paced_and_registered_under_json_s_content_type():
    meta = {"status": "SUCCESS", "result": result(50), "traceback": None, "children": [], "task_id": "t"}
    content_type, encoding, payload = serialization.dumps(meta, serializer=PACED_JSON)
    assert (content_type, encoding) == ("application/json", "utf-8")
    assert payload == kombu_dumps(meta) == paced_result_json(meta)
    accept = serialization.prepare_accept_content(["json"])
    assert serialization.loads(payload, content_type, encoding, accept=accept) == json.loads(payload)


class Ticker:
    """A thread that releases the GIL for 0.2 ms and takes it back, until stopped; longest: its
    longest gap between two ticks, less its own run-queue wait."""

    def __init__(self) -> None:
        self.longest = Pause()
        self.running = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        clock = PauseClock(time.perf_counter(), schedstat_path())
        self.running.set()
        while not self._stop.is_set():
            time.sleep(0.0002)
            clock.tick(time.perf_counter())
        self.longest = clock.longest

    def __enter__(self) -> Ticker:
        self._thread.start()
        self.running.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def big() -> Iterator[dict[str, Any]]:
    value = {"logprobs": logprobs(TOKENS)}
    with frozen_heap():  # as the worker after its warm-up: no full collection of the session's heap
        yield value


def test_one_json_dumps_keeps_the_gil_from_the_ticker_throughout(big: dict[str, Any]):
    """The control: the ticker does see a thread that holds the GIL past the paced bound."""
    with Ticker() as ticker:
        started = time.thread_time()
        json.dumps(big)
        held = time.thread_time() - started
    assert held > 2 * LONGEST_HOLD_S
    assert ticker.longest.engine_s > LONGEST_HOLD_S, f"json.dumps held the GIL {held * 1000:.0f} ms: {ticker.longest}"


def test_a_paced_job_leaves_the_ticker_the_gil_within_about_a_slice(big: dict[str, Any]):
    with Ticker() as ticker:
        with PACER.turn() as pace:
            text = dumps_paced(big, pace)
    assert text == json.dumps(big)
    assert SLICE_S < LONGEST_HOLD_S
    assert ticker.longest.engine_s < LONGEST_HOLD_S, f"the paced job kept the GIL {ticker.longest}"
