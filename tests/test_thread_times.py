"""worker/thread_times.py reads a thread's own CPU time and run-queue wait from the kernel: the engine
loop's stats split its steps with them (bench/celery_gil.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from worker.thread_times import thread_times

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task is Linux's")


def test_a_thread_s_cpu_time_grows_with_its_work_and_not_with_its_sleep():
    me = threading.get_native_id()
    before = thread_times(me)
    assert before is not None
    time.sleep(0.05)
    slept = thread_times(me)
    assert slept is not None and slept.cpu_s - before.cpu_s < 0.04
    started = time.thread_time()
    while time.thread_time() - started < 0.05:
        pass
    worked = thread_times(me)
    assert worked is not None and worked.cpu_s - slept.cpu_s >= 0.04
    assert worked.run_queue_s >= before.run_queue_s >= 0


def test_no_thread_no_times():
    assert thread_times(None) is None
    assert thread_times(2**31 - 1) is None
