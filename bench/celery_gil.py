"""How much the Celery side of a worker delays the engine loop's steps through the GIL (issue 30).

A GPU's step is a wait the engine loop spends with the GIL released; meanwhile the worker's other
threads (Celery's consumer and task threads receiving, validating and tokenizing new requests, the
publishing threads) take it, and when the forward ends the loop may have to wait for it. This
benchmark runs one real `genq worker` with the synthetic engine (engine/synthetic.py) at a GPU-like
step: `--synthetic-step-ms 15` (every step waits 15 ms with the GIL released, whatever its batch,
as a decode step reads the weights) and a rate so high that the batch adds next to nothing. A
producer in this process sends text prompts (the worker tokenizes them) with a broker-only Celery
client at a steady N new requests/s (50, 100, 200, 500), each of T = round(B / (N x 15 ms)) new
tokens, so the batch stays near B = 64 whatever N; the baseline is the same batch with no intake:
B requests long enough to outlast the window, sent before it. A baseline window runs before the
first rate and after each one, and each rate is set against the mean of the two around it (their
spread is the noise of the split on this machine).

Over a window of --seconds (after a warm-up), from the worker's `engine_stats`, which reads the
loop's steps and busy seconds together with the kernel's schedstat of the loop thread (its CPU time
and the time it waited on a run queue for a core: worker/thread_times.py), per step:
  step           the window's seconds (the worker's clock, read with the counters) / steps (the loop
                 is busy throughout: loop_busy_share in the JSON is its busy seconds over the window's)
  forward        the synthetic waits asked for (15 ms + batch / rate each: the worker's forward_wait_s)
  loop CPU       the loop thread's own CPU time (its host work: admission, the output processor's
                 text, events)
  run queue      time the loop thread was runnable but had no core (the machine's other processes)
  GIL wait       the rest: step - forward - loop CPU - run queue, time the loop thread neither ran
                 nor waited for a core, i.e. waited for the GIL (and the timer's slack on the wait);
                 on a loaded machine the split of the baseline itself drifts by a millisecond or so
The requests asked for, sent (this process's Celery client) and taken through the engine per second
(generated tokens / T over the window) are reported apart: the latter is the intake the loop saw.
The intake's GIL cost at N is GIL wait(N) - GIL wait(baseline), as a share of the step at N: issue
30 moves the engine core into a process of its own when that exceeds 5% at the rates a GPU sees.
Each GIL switch interval of --switch-ms (CPython's 5 ms and 0.5 ms by default) gets a worker of its
own (GENQ_SWITCH_INTERVAL_MS): the interval bounds how long another thread keeps the GIL once the
loop asks for it.
Writes <out>/celery_gil.json and .png (celery_gil_quick.* with --quick) and prints a markdown table.
Needs redis-server on the PATH.
"""

from __future__ import annotations

import argparse
import itertools
import math
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend
from bench_common import (  # noqa: E402
    bench_main,
    bench_parser,
    ensure_model,
    measured_when,
    progress,
    save_figure,
    start_run,
    table_lines,
)
from celery import Celery  # noqa: E402
from service_runners import install_sigterm_as_interrupt  # noqa: E402

from producer.protocol import TASK_NAME  # noqa: E402
from worker.processes import RedisServer, WorkerProcess, wait_until  # noqa: E402

RATES = (50, 100, 200, 500)
QUICK_RATES = (100, 500)
STEP_MS = 15.0
SYNTHETIC_RATE = 10_000_000  # tokens/s: 64 jobs add 6.4 us to a step, next to nothing
BATCH = 64
WORKER_SLOTS = 192  # task threads and batch: room for the batch and the requests on their way
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife."
MEASURE_S = 5.0
QUICK_MEASURE_S = 2.0
WARM_S = 1.5
QUEUE = "genq-gil"
TIMEOUT_S = 300.0
GIL_LIMIT = 0.05
SENDS_PER_THREAD = 100
SWITCH_MS = (5, 0.5)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, quick=f"rates {', '.join(map(str, QUICK_RATES))} only, {QUICK_MEASURE_S:g} s "
                                         "windows; writes celery_gil_quick.{json,png}",
                          epilog="About a minute; run it on a quiet machine.")
    parser.add_argument("--rates", default=None, help="comma-separated new requests/s "
                                                      f"(default {','.join(map(str, RATES))})")
    parser.add_argument("--switch-ms", default=",".join(map(str, SWITCH_MS)),
                        help="comma-separated GIL switch intervals, one worker each (GENQ_SWITCH_INTERVAL_MS; default "
                             f"{','.join(map(str, SWITCH_MS))})")
    parser.add_argument("--step-ms", type=float, default=STEP_MS, help=f"the synthetic step (default {STEP_MS:g})")
    args = parser.parse_args(argv)
    args.switch_ms = tuple(float(value) for value in args.switch_ms.split(","))
    args.seconds = QUICK_MEASURE_S if args.quick else MEASURE_S
    args.rates = (QUICK_RATES if args.quick else RATES) if args.rates is None else tuple(
        int(rate) for rate in args.rates.split(","))
    return args


def snapshot(worker: WorkerProcess, celery: Celery) -> dict[str, float]:
    """The loop's counters now, read together by the worker: steps, busy seconds, generated tokens, and
    its thread's CPU and run-queue seconds."""
    stats = worker.engine_stats(celery)
    assert stats is not None
    return {"steps": stats["steps"], "busy_s": stats["busy_s"], "tokens": stats["generated_tokens"],
            "forward_s": stats["forward_wait_s"], "cpu_s": stats["loop_cpu_s"],
            "run_queue_s": stats["loop_run_queue_s"], "wall_s": stats["loop_clock_s"]}


class Producer:
    """Sends `rate` requests/s of `tokens` new tokens each, on a fixed schedule (a late send is not made up
    by a burst: the schedule moves on), from one thread per SENDS_PER_THREAD requests/s, until stopped."""

    def __init__(self, celery: Celery, rate: float, tokens: int, name: str) -> None:
        self.celery, self.tokens, self.name = celery, tokens, name
        count = max(1, math.ceil(rate / SENDS_PER_THREAD))
        self.interval = count / rate
        self.sent = 0
        self._ids = itertools.count()
        self._counting = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"producer-{name}-{i}", daemon=True)
                         for i in range(count)]

    def __enter__(self) -> Producer:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            self.celery.send_task(TASK_NAME, queue=QUEUE, kwargs={
                "prompt": PROMPT, "max_new_tokens": self.tokens, "ignore_eos": True, "sampling": {"temperature": 0},
                "identifier": f"{self.name}-{next(self._ids)}"})
            with self._counting:
                self.sent += 1
            due = max(due + self.interval, time.monotonic())
            self._stop.wait(due - time.monotonic())


def per_step(before: dict[str, float], after: dict[str, float], step_s: float) -> dict[str, float]:
    """The window's figures per step, in ms, and the batch."""
    steps = after["steps"] - before["steps"]
    busy = after["busy_s"] - before["busy_s"]
    wall = after["wall_s"] - before["wall_s"]
    batch = (after["tokens"] - before["tokens"]) / steps
    forward = (after["forward_s"] - before["forward_s"]) / steps
    cpu = (after["cpu_s"] - before["cpu_s"]) / steps
    queued = (after["run_queue_s"] - before["run_queue_s"]) / steps
    step = wall / steps
    return {"steps": steps, "batch": round(batch, 1), "step_ms": round(1000 * step, 3),
            "forward_ms": round(1000 * forward, 3), "loop_cpu_ms": round(1000 * cpu, 3),
            "run_queue_ms": round(1000 * queued, 3), "gil_wait_ms": round(1000 * (step - forward - cpu - queued), 3),
            "beyond_forward_ms": round(1000 * (step - forward), 3),
            "loop_busy_share": round(busy / wall, 4)}


def measure(celery: Celery, sender: Celery, worker: WorkerProcess, rate: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """One window at `rate` new requests/s (0: the baseline, BATCH long requests and no intake), sent by
    `sender`, a broker-only client: a client with a result backend subscribes to each task's result as it
    sends it, which holds this process to about 140 sends/s on this machine."""
    step_s = args.step_ms / 1000
    start = worker.engine_stats(celery)
    assert start is not None
    if rate == 0:
        tokens = round((WARM_S + args.seconds + 1) / step_s)
        for i in range(BATCH):
            celery.send_task(TASK_NAME, queue=QUEUE, kwargs={
                "prompt": PROMPT, "max_new_tokens": tokens, "ignore_eos": True, "identifier": f"base-{i}"})
        wait_until(lambda: (worker.engine_stats(celery) or {}).get("active_jobs") == BATCH, 60, "the baseline batch")
        time.sleep(WARM_S)  # the window's start: a measured span, not an event
        before = snapshot(worker, celery)
        time.sleep(args.seconds)
        after = snapshot(worker, celery)
        sent = BATCH
    else:
        tokens = max(1, round(BATCH / (rate * step_s)))
        with Producer(sender, rate, tokens, f"rate{rate}") as producer:
            time.sleep(WARM_S)
            before = snapshot(worker, celery)
            sent_before = producer.sent
            time.sleep(args.seconds)
            after = snapshot(worker, celery)
            arrived = (producer.sent - sent_before) / (after["wall_s"] - before["wall_s"])
        sent = producer.sent
    expected = start["completed"] + sent
    wait_until(lambda: (worker.engine_stats(celery) or {}).get("completed", 0) >= expected, TIMEOUT_S,
               f"{sent} requests at {rate}/s to complete")
    figures = per_step(before, after, step_s)
    progress(f"{rate or 'no'} new requests/s: step {figures['step_ms']:.2f} ms, GIL wait {figures['gil_wait_ms']:.3f} "
             f"ms, run queue {figures['run_queue_ms']:.3f} ms, batch {figures['batch']:.0f}")
    admitted = (after["tokens"] - before["tokens"]) / tokens / (after["wall_s"] - before["wall_s"])
    return {"new_requests_per_s": rate, "tokens_per_request": tokens, "requests": sent,
            "sent_per_s": round(arrived, 1) if rate else 0.0,
            "through_engine_per_s": round(admitted, 1) if rate else 0.0,
            **figures}


def measure_worker(switch_ms: float, args: argparse.Namespace, model: Path, server: RedisServer, workdir: Path
                   ) -> dict[str, Any]:
    """One worker with this GIL switch interval: a baseline, then each rate followed by a baseline again."""
    celery = Celery("bench-client", broker=server.url, backend=server.url)
    sender = Celery("bench-sender", broker=server.url)
    options = {"synthetic_rate": SYNTHETIC_RATE, "synthetic_step_ms": args.step_ms, "concurrency": WORKER_SLOTS,
               "max_batch_size": WORKER_SLOTS, "switch_interval_ms": switch_ms}
    progress(f"a worker with a {switch_ms:g} ms GIL switch interval")
    with WorkerProcess(model, server.url, QUEUE, f"gil-{switch_ms:g}", workdir / f"worker-{switch_ms:g}.log",
                       options) as worker:
        worker.wait_ready(celery)
        baselines = [measure(celery, sender, worker, 0, args)]
        windows = []
        for rate in args.rates:
            windows.append(measure(celery, sender, worker, rate, args))
            baselines.append(measure(celery, sender, worker, 0, args))
    for window, (earlier, later) in zip(windows, zip(baselines, baselines[1:])):
        reference = (earlier["gil_wait_ms"] + later["gil_wait_ms"]) / 2
        window["baseline_gil_wait_ms"] = round(reference, 3)
        window["baseline_spread_ms"] = round(abs(earlier["gil_wait_ms"] - later["gil_wait_ms"]), 3)
        window["gil_cost_ms"] = round(window["gil_wait_ms"] - reference, 3)
        window["gil_cost_share"] = round(window["gil_cost_ms"] / window["step_ms"], 4)
    return {"switch_interval_ms": switch_ms, "windows": windows, "baselines": baselines,
            "rates_over_limit": [w["new_requests_per_s"] for w in windows if w["gil_cost_share"] > GIL_LIMIT]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    install_sigterm_as_interrupt()
    machine = start_run(1)
    model = ensure_model("tiny")
    with tempfile.TemporaryDirectory(prefix="genq-gil-") as tmp, \
            RedisServer(Path(tmp), persistence="none") as server:
        workers = [measure_worker(switch_ms, args, model, server, Path(tmp)) for switch_ms in args.switch_ms]
    return {"benchmark": "celery_gil", "machine": machine, "step_ms": args.step_ms, "synthetic_rate": SYNTHETIC_RATE,
            "batch": BATCH, "window_s": args.seconds, "gil_limit": GIL_LIMIT, "workers": workers}


def markdown_table(results: dict[str, Any]) -> str:
    rows = []
    for worker in results["workers"]:
        switch = f"{worker['switch_interval_ms']:g}"
        for w in worker["windows"]:
            rows.append([switch, w["new_requests_per_s"], f"{w['sent_per_s']:.0f}", f"{w['through_engine_per_s']:.0f}",
                         w["tokens_per_request"], f"{w['batch']:.0f}", f"{w['step_ms']:.2f}",
                         f"{w['loop_cpu_ms']:.2f}", f"{w['run_queue_ms']:.2f}", f"{w['gil_wait_ms']:.2f}",
                         f"{w['baseline_gil_wait_ms']:.2f} ± {w['baseline_spread_ms'] / 2:.2f}",
                         f"{w['gil_cost_ms']:+.2f} ({w['gil_cost_share']:+.1%})"])
        b = worker["baselines"]
        rows.append([switch, "none", "0", "0", b[0]["tokens_per_request"], f"{b[0]['batch']:.0f}",
                     *(f"{min(x[key] for x in b):.2f}–{max(x[key] for x in b):.2f}"
                       for key in ("step_ms", "loop_cpu_ms", "run_queue_ms", "gil_wait_ms")), "", ""])
    header = ["GIL switch ms", "new requests/s asked", "sent/s", "through the engine/s", "tokens each", "batch",
              "step ms", "loop CPU ms", "run queue ms", "GIL wait ms", "no intake, before and after: GIL wait ms",
              "intake's GIL cost ms (share of step)"]
    notes = [f"\nforward {results['step_ms']:g} ms a step (synthetic), {results['window_s']:g} s windows; "
             f"{measured_when(results['machine'])}"]
    for worker in results["workers"]:
        over = worker["rates_over_limit"]
        notes.append(f"switch interval {worker['switch_interval_ms']:g} ms: intake's GIL cost above "
                     f"{results['gil_limit']:.0%} of the step at {', '.join(map(str, over)) or 'no rate'}"
                     f"{' requests/s' if over else ''}")
    return "\n".join([*table_lines(header, "rrrrrrrrrrrr", rows), *notes])


def plot(results: dict[str, Any], path: Path) -> None:
    workers = results["workers"]
    fig, axes = plt.subplots(1, len(workers), figsize=(7 * len(workers), 4.5), sharey=True, squeeze=False)
    for ax, worker in zip(axes[0], workers):
        windows = [worker["baselines"][0], *worker["windows"]]
        labels = [str(w["new_requests_per_s"] or "none") for w in windows]
        bottom = [0.0] * len(windows)
        for key, label in (("loop_cpu_ms", "loop CPU"), ("run_queue_ms", "run queue (no core)"),
                           ("gil_wait_ms", "GIL wait")):
            values = [w[key] for w in windows]
            ax.bar(labels, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set(xlabel="new requests/s through Celery", ylabel="ms per step beyond the forward",
               title=f"GIL switch interval {worker['switch_interval_ms']:g} ms")
        ax.legend()
    fig.suptitle(f"engine loop step beyond a {results['step_ms']:g} ms synthetic forward, batch ~{results['batch']}")
    save_figure(fig, path)


main = bench_main("celery_gil", parse_args, run, plot, markdown_table)

if __name__ == "__main__":
    main()
