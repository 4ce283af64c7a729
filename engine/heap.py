"""The cyclic garbage collector's settings for a process that owns an engine for its lifetime.

A decode step allocates and frees thousands of short-lived container objects (lists, the step's
records, result dicts); reference counting frees nearly all of them, but every 700 net allocations
CPython runs a young-generation pass, and every hundredth pass a full one that walks every tracked
object in the process: the model's modules, the tokenizer's tables, the imports. Those live as long
as the process, so once loading is over they are moved out of the collector's reach (`gc.freeze`,
as vLLM's engine core does after its startup), and the young generation is collected less often.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000
"""Net allocations between young-generation passes (CPython's default: 700). A pass walks only the
objects still alive since the last one, so fewer passes cost less in all: a 256-job decode step ran
about two passes at 700 (~0.18 ms of its host time) and none in 50 steps at 10,000, whose rarer
passes each take longer (0.16 ms over 10,000 live lists against 0.04 ms over 700, on a 2-core VM)."""


def settle_startup_heap() -> None:
    """Call once, when the model, caches and tokenizer are loaded and warmed up: what is alive then
    is collected once, then frozen (never walked again by any pass), and the young generation's
    threshold raised. Process-wide, so the process's owner calls it (the worker's startup, a
    benchmark's), never a library call that a process may run many times."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, older, oldest)
