"""Checking a request's output constraint at the gateway, before it is queued.

A JSON Schema, regex or grammar that does not compile, or that trips one of llguidance's limits,
would fail the request on the worker; checked here, the caller gets a 400 naming the problem at
once (and a streamed request never starts with 200). The check compiles the grammar
producer.protocol.grammar_source makes of the constraint with llguidance, the library the
worker's engine constrains decoding with (it imports no torch), so the two agree; the worker
still checks, for producers that bypass the gateway.

A check can take seconds of CPU (GBNF's conversion is pure Python and quadratic; a JSON Schema of
thousands of properties compiles for seconds), so it never runs on the event loop: it runs in a
pool of grammar_check_workers processes. Processes, not threads: the GBNF converter holds the
GIL, and a thread running it would still stall the event loop between its switch intervals.
Each check is bounded by grammar_check_timeout_s (in the check process, producer/grammar_check.py)
and grammar_max_size; a constraint over either is a 400 naming the limit. Results are cached by
the grammar's SHA-256, refusals included, so a repeated grammar costs nothing. Checks wait for a
free process in arrival order, at most WAITING_PER_WORKER per process; one more is a 429.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from producer.gateway.errors import ApiError
from producer.gateway.settings import GatewaySettings
from producer.grammar_check import check_grammar
from producer.protocol import OutputConstraint, grammar_source

WAITING_PER_WORKER = 8
"""Checks that may wait for a busy process, per process: each waits at most this many budgets."""
TIMEOUT_GRACE_S = 1.0
"""How long past its budget the gateway waits for a check process's own timeout before answering
the request itself (llguidance's compiled code notices the timer only when it returns)."""


class ConstraintChecker:
    """The gateway's grammar checks: a bounded process pool, a time and size budget, a cache."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.timeout_s = settings.grammar_check_timeout_s
        self.max_grammar_size = settings.grammar_max_size
        self.cache_size = settings.grammar_cache_size
        self.retry_after_s = settings.retry_after_s
        self._cache: OrderedDict[str, str | None] = OrderedDict()
        self._workers = settings.grammar_check_workers
        self._pool = self._new_pool()
        self._slots = asyncio.Semaphore(settings.grammar_check_workers)
        self._max_waiting = WAITING_PER_WORKER * settings.grammar_check_workers
        self._waiting = 0

    async def problem(self, constraint: OutputConstraint) -> str | None:
        """Why the constraint cannot run ("constraint: <syntax>: <problem>", one line), or None;
        ApiError 429 when too many checks already wait for a process."""
        syntax, text = grammar_source(constraint)
        key = hashlib.sha256(f"{syntax}\0{text}".encode()).hexdigest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if self._slots.locked() and self._waiting >= self._max_waiting:
            raise ApiError(429, "grammar_checks_busy", f"{self._waiting} constraints are waiting for a grammar check "
                                                       f"process (grammar_check_workers); retry later",
                           headers={"Retry-After": str(self.retry_after_s)})
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        # The slot is given back when the process is free (on the loop's thread), not when this
        # request stops waiting.
        check: Future[str | None] = self._pool.submit(check_grammar, syntax, text, self.timeout_s,
                                                      self.max_grammar_size)
        loop = asyncio.get_running_loop()
        check.add_done_callback(lambda _: loop.call_soon_threadsafe(self._slots.release))
        try:
            problem = await asyncio.wait_for(asyncio.wrap_future(check), self.timeout_s + TIMEOUT_GRACE_S)
        except TimeoutError:
            problem = (f"constraint: {syntax}: checking the grammar took longer than {self.timeout_s:g} s "
                       f"(grammar_check_timeout_s)")
        except BrokenProcessPool:  # the check process died on this grammar (out of memory, a crash)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            problem = f"constraint: {syntax}: checking the grammar crashed its check process"
        self._remember(key, problem)
        return problem

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: forking a process that runs an event loop and threads is unsafe.
        return ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"))

    def _remember(self, key: str, problem: str | None) -> None:
        if self.cache_size == 0:
            return
        self._cache[key] = problem
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
