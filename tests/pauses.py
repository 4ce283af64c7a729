"""A loop thread's pauses, told apart from the CPU time the machine did not give it.

Issue 23 bounds the engine loop's longest pause while a hostile request is admitted at 100 ms.
A wall-clock gap between two of the loop's steps is the loop's own work, plus time it waited for
a lock (the GIL, say) or for other threads, plus time it was runnable but the kernel ran
something else on the CPUs. On a small machine shared with other jobs that last part alone
exceeds 100 ms now and then, whatever the engine does. Linux counts it per thread: the second
field of /proc/<pid>/task/<tid>/schedstat is the nanoseconds the thread has waited on a run
queue (sched_info's run_delay). A pause minus that wait is what the engine made the loop spend:
its own work and its waits, none of which a hostile request may stretch past the bound.

A full garbage collection stops every thread while it walks the heap: in a test session that has
loaded a thousand tests' objects it takes half a second and more, where the worker, which
freezes its startup objects after warm-up (worker/runtime.py), walks only what it made since.
Tests that time a loop run inside `frozen_heap()`, which does the same with the session's heap,
and every pause says how much of it was collection, so a failure names the cause.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.heap import settle_startup_heap


def schedstat_path(pid: int | None = None, tid: int | None = None) -> Path:
    """A thread's schedstat: this thread's by default."""
    if pid is None and tid is None:
        return Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    return Path(f"/proc/{pid}/task/{tid}/schedstat")


class _CollectionClock:
    """Seconds the process has spent in garbage collection since it was imported (gc.callbacks)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._started


COLLECTIONS = _CollectionClock()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The collector as the worker leaves it after its warm-up (engine/heap.py: what is alive now
    left out of its passes, the young generation collected less often); the session's heap is
    collected as before afterwards."""
    threshold = gc.get_threshold()
    settle_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def run_queue_wait_s(path: Path) -> float:
    """Seconds the thread has waited for a CPU while runnable, since it started; 0 where the
    kernel does not count it (the pause is then taken whole: never more lenient)."""
    try:
        return int(path.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass(frozen=True)
class Pause:
    """One gap between two of the loop's steps: its wall time, how much of it the loop thread
    spent waiting for a CPU, how long the process spent in garbage collection in it, and the
    thread's own CPU time in it (what is left of the wall time is the thread asleep: waiting
    for the GIL, a lock or I/O)."""

    wall_s: float = 0.0
    run_queue_s: float = 0.0
    collection_s: float = 0.0
    running_s: float = 0.0

    @property
    def engine_s(self) -> float:
        return max(0.0, self.wall_s - self.run_queue_s)

    def __str__(self) -> str:
        return f"{self.engine_s * 1000:.0f} ms ({self.wall_s * 1000:.0f} ms wall, " \
               f"{self.run_queue_s * 1000:.0f} ms waiting for a CPU, {self.running_s * 1000:.0f} ms running, " \
               f"{self.collection_s * 1000:.0f} ms collecting garbage)"


class PauseClock:
    """Gaps between ticks of one thread's loop, each with that thread's run-queue wait; made and
    ticked on that thread (its CPU time is time.thread_time's)."""

    def __init__(self, clock: float, path: Path) -> None:
        self.path = path
        self._last = clock
        self._last_wait = run_queue_wait_s(path)
        self._last_collections = COLLECTIONS.total_s
        self._last_running = time.thread_time()
        self.longest = Pause()

    def tick(self, clock: float, count: bool = True) -> Pause:
        """The gap since the last tick; the longest of those counted is kept."""
        wait, collections, running = run_queue_wait_s(self.path), COLLECTIONS.total_s, time.thread_time()
        pause = Pause(clock - self._last, wait - self._last_wait, collections - self._last_collections,
                      running - self._last_running)
        self._last, self._last_wait = clock, wait
        self._last_collections, self._last_running = collections, running
        if count and pause.engine_s > self.longest.engine_s:
            self.longest = pause
        return pause
