"""A thread's CPU time and run-queue wait as the kernel counts them (/proc/self/task/TID/schedstat), so
the engine loop's stats can split a step's wall time into its own work, waiting for a core, and the
rest (its forward's wait, and the GIL: bench/celery_gil.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NANOSECONDS = 1e9


@dataclass(frozen=True)
class ThreadTimes:
    cpu_s: float
    run_queue_s: float


def thread_times(native_id: int | None) -> ThreadTimes | None:
    """The thread's times so far; None where there is no such thread or no /proc (not Linux)."""
    if native_id is None:
        return None
    try:
        cpu_ns, queued_ns, _ = Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return ThreadTimes(int(cpu_ns) / NANOSECONDS, int(queued_ns) / NANOSECONDS)
