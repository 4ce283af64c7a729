"""A loop thread's pauses, told apart from the CPU time the machine did not give it.

Issue 23 bounds the engine loop's longest pause while a hostile request is admitted at 100 ms.
A wall-clock gap between two of the loop's steps is the loop's own work, plus time it waited for
a lock (the GIL, say) or for other threads, plus time it was runnable but the kernel ran
something else on the CPUs. On a small machine shared with other jobs that last part alone
exceeds 100 ms now and then, whatever the engine does. Linux counts it per thread: the second
field of /proc/<pid>/task/<tid>/schedstat is the nanoseconds the thread has waited on a run
queue (sched_info's run_delay). A pause minus that wait is what the engine made the loop spend:
its own work and its waits, none of which a hostile request may stretch past the bound.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path


def schedstat_path(pid: int | None = None, tid: int | None = None) -> Path:
    """A thread's schedstat: this thread's by default."""
    if pid is None and tid is None:
        return Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    return Path(f"/proc/{pid}/task/{tid}/schedstat")


def run_queue_wait_s(path: Path) -> float:
    """Seconds the thread has waited for a CPU while runnable, since it started; 0 where the
    kernel does not count it (the pause is then taken whole: never more lenient)."""
    try:
        return int(path.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass(frozen=True)
class Pause:
    """One gap between two of the loop's steps: its wall time, and how much of it the loop
    thread spent waiting for a CPU."""

    wall_s: float = 0.0
    run_queue_s: float = 0.0

    @property
    def engine_s(self) -> float:
        return max(0.0, self.wall_s - self.run_queue_s)

    def __str__(self) -> str:
        return f"{self.engine_s * 1000:.0f} ms ({self.wall_s * 1000:.0f} ms wall, " \
               f"{self.run_queue_s * 1000:.0f} ms waiting for a CPU)"


class PauseClock:
    """Gaps between ticks of one thread's loop, each with that thread's run-queue wait."""

    def __init__(self, clock: float, path: Path) -> None:
        self.path = path
        self._last = clock
        self._last_wait = run_queue_wait_s(path)
        self.longest = Pause()

    def tick(self, clock: float, count: bool = True) -> Pause:
        """The gap since the last tick; the longest of those counted is kept."""
        wait = run_queue_wait_s(self.path)
        pause = Pause(clock - self._last, wait - self._last_wait)
        self._last, self._last_wait = clock, wait
        if count and pause.engine_s > self.longest.engine_s:
            self.longest = pause
        return pause
