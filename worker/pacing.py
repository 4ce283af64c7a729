"""Big CPU work beside the engine loop, in slices that leave the loop the GIL (issue 23).

The engine loop gives up the GIL at every torch op of a step and then waits to take it back.
While another thread runs Python, each of those waits can last the interpreter's switch
interval (5 ms), and while it is inside one long C call the whole call: one json.dumps of a
result of 2,000 tokens with 20 alternatives each holds the GIL about 90 ms here
(tests/test_pacing.py). Measured in one process on this 2-core machine, building and encoding
16 results of 128 such tokens beside a generator stepping a canary stretched its longest step
(less its wait for a CPU) from about 35 ms alone to 79 to 207 ms; paced, 34 to 61 ms.

Work paced here runs one job at a time (PACER's lock), in slices of about SLICE_S, each
followed by REST_S asleep, GIL released: the loop then waits at most about a slice for the GIL,
and runs free while the job rests. dumps_paced encodes a big JSON value in such slices, to the
same text json.dumps makes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kombu.utils.json import dumps as kombu_dumps

SLICE_S = 0.002
REST_S = 0.002
LEAF_WEIGHT = 256
"""The most scalars encoded by one call of the leaf encoder: about a tenth of a millisecond."""

Pace = Callable[[], None]
Encode = Callable[[Any], str]


class Pacer:
    """Runs paced jobs one at a time; pace() rests once a slice of work has run."""

    def __init__(self, slice_s: float = SLICE_S, rest_s: float = REST_S) -> None:
        self.slice_s = slice_s
        self.rest_s = rest_s
        self._lock = threading.Lock()

    @contextmanager
    def turn(self) -> Iterator[Pace]:
        """This thread's turn to run a paced job; the job calls the yielded pace() between
        small steps of its work. Other paced jobs wait (asleep) for the turn."""
        with self._lock:
            sliced = time.monotonic()

            def pace() -> None:
                nonlocal sliced
                if time.monotonic() - sliced >= self.slice_s:
                    time.sleep(self.rest_s)
                    sliced = time.monotonic()

            yield pace


PACER = Pacer()
"""The worker's one pacer: the finishing thread's results and Celery's result encoding share it,
so that their rests are the loop's, not another paced job's turn."""


def no_pace() -> None:
    """For work that need not be paced (a test, a small result)."""


def dumps_paced(value: Any, pace: Pace, encode: Encode = json.dumps) -> str:
    """json.dumps(value)'s text (encode's, with its default separators), made in calls of encode
    on pieces of at most about LEAF_WEIGHT scalars, pace() after each."""
    parts: list[str] = []
    _encode(value, pace, encode, parts)
    return "".join(parts)


def paced_result_json(value: Any) -> str:
    """Celery's result serializer in the worker (worker/app.py): kombu's JSON, paced, since the
    result backend encodes every result once more on its task's thread."""
    with PACER.turn() as pace:
        return dumps_paced(value, pace, kombu_dumps)


def _encode(value: Any, pace: Pace, encode: Encode, parts: list[str]) -> None:
    if _weight(value) <= LEAF_WEIGHT:
        parts.append(encode(value))
        pace()
    elif isinstance(value, dict):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append(f"{', ' if i else ''}{encode(key)}: ")
            _encode(item, pace, encode, parts)
        parts.append("}")
    else:
        items = list(value)
        batch = max(1, LEAF_WEIGHT // _item_weight(items))
        parts.append("[")
        for start in range(0, len(items), batch):
            if start:
                parts.append(", ")
            if batch == 1:
                _encode(items[start], pace, encode, parts)
            else:
                parts.append(encode(items[start:start + batch])[1:-1])
                pace()
        parts.append("]")


def _weight(value: Any) -> int:
    """About how many scalars value holds, guessing a list's items alike (_item_weight); a
    dict with a key other than a string counts as a scalar, so encode takes it whole (its keys
    become strings the way json.dumps makes them)."""
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            return 1
        return 1 + sum(_weight(item) for item in value.values())
    if isinstance(value, list | tuple):
        return 1 + (len(value) * _item_weight(value) if value else 0)
    return 1


def _item_weight(items: list[Any] | tuple[Any, ...]) -> int:
    """A non-empty list's heaviest of its first, middle and last items (a prompt's logprobs
    begin with None, the first token's)."""
    return max(_weight(items[0]), _weight(items[len(items) // 2]), _weight(items[-1]))
