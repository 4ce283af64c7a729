"""Fair share under a flood: one tenant's time to first chunk while another floods the queue.

One run starts a private redis-server and, per mode, one real `genq worker` (tiny random-weight
llama, --concurrency task slots, the engine's batch as large). The interactive tenant sends
--interactive requests one after the other (a short prompt, 2 new tokens, EOS ignored), each
timed from submit to its first `chunk` event on the request's pub/sub channel; its final event's
`timings.queued_s` says how much of that it waited in the engine's queue and `timings.prefill_s`
how long its prefill step took (the rest: in the broker, the worker's intake, the step in progress
when it arrived and the way back):

  idle     the interactive tenant alone: the baseline.
  shared   the flood tenant first sends --flood requests at once (8 to 24 new tokens each,
           EOS ignored), then the interactive tenant sends its requests; one list per queue
           (tenant lanes off), as before issue 29.
  mixed    the same with GENQ_TENANT_LANES=--lanes on the producer and the worker: the two
           tenants wait in lists of their own, which the worker takes from in turn, no list
           holding the one reserved task slot (GENQ_LANE_RESERVE=1); the interactive request's
           prefill runs in a step beside the flood's decoding rows (GENQ_NEWCOMER_FIRST off, the
           policy before it).
  lanes    the same with the newcomer step (GENQ_NEWCOMER_FIRST, the default): the prefill of a
           tenant with nothing running gets an engine step of its own (docs/engine.md).

The interactive requests start once the worker holds --concurrency flood tasks; the run records
how many flood tasks were still queued when the last interactive request got its first chunk.
With --rounds R the four modes run R times in turn, --interactive requests each time, and each
mode's figures pool its R runs: on a machine whose load drifts, every mode samples the same
stretch of it.

    python bench/fairness.py            # 200 flood tasks, 20 interactive requests, concurrency 4, 1 round
    python bench/fairness.py --quick    # 60 flood tasks, 5 interactive requests
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_common import (
    bench_main,
    bench_parser,
    ensure_model,
    percentiles_ms,
    progress,
    save_figure,
    start_run,
    subplots,
)

from producer.client import GenqClient
from producer.routing import tenant_queue
from worker.processes import RedisServer, WorkerProcess

TIMING_METHOD = ("wall: time.perf_counter() from submit to the request's first chunk event (pub/sub); "
                 "engine wait and prefill step: the final event's timings.queued_s and prefill_s")
FLOOD, INTERACTIVE = "flood", "interactive"  # different lanes of 4
MODES = ("idle", "shared", "mixed", "lanes")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, "60 flood tasks, 5 interactive requests; writes fairness_quick.{json,png}",
                          "Four modes (idle, one shared list, lanes with mixed steps, lanes with newcomer steps), "
                          "each with its own worker; a few minutes.")
    parser.add_argument("--flood", type=int, default=200, help="requests the flooding tenant sends at once")
    parser.add_argument("--interactive", type=int, default=20, help="requests the other tenant sends, one by one")
    parser.add_argument("--rounds", type=int, default=1, help="times the modes run in turn, pooled per mode")
    parser.add_argument("--concurrency", type=int, default=4, help="the worker's task slots and engine batch")
    parser.add_argument("--lanes", type=int, default=4, help="GENQ_TENANT_LANES in the lanes mode")
    parser.add_argument("--preset", default="tiny", help="tiny model preset (genq_dev/tiny_model.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.flood, args.interactive = 60, 5
    return args


def timed_request(client: GenqClient, tenant: str) -> tuple[float, float, float]:
    """Seconds from submit to the first chunk event, of them waiting in the engine's queue, and the
    request's prefill (its timings.prefill_s).
    Returns once the result is stored, as a user who reads the whole answer before asking again."""
    begun = time.perf_counter()
    first_chunk = None
    handle = client.submit({"prompt": "Hello there, how are", "max_new_tokens": 2, "ignore_eos": True,
                            "tenant": tenant}, identifier=f"{tenant}-{uuid.uuid4().hex[:12]}")
    try:
        for event in handle.events(timeout=600):
            if event.event == "chunk" and first_chunk is None:
                first_chunk = time.perf_counter() - begun
            elif event.event == "done" and first_chunk is not None and event.timings is not None:
                handle.result(timeout=600)
                return first_chunk, event.timings.queued_s, event.timings.prefill_s
        raise RuntimeError(f"request {handle.id} ended without a chunk and its timings")
    finally:
        handle.close()


def run_mode(mode: str, model: Path, args: argparse.Namespace, redis_url: str, workdir: Path
             ) -> tuple[list[tuple[float, float, float]], int | None]:
    """The interactive requests' timings (timed_request) and the flood tasks still queued after them."""
    queue = f"bench-fair-{mode}"
    lanes = args.lanes if mode in ("mixed", "lanes") else 0
    options = {"cache_tokens": 16384, "page_size": 16, "concurrency": args.concurrency,
               "max_batch_size": args.concurrency, "tenant_lanes": lanes, "shutdown_grace": 0,
               **({"no_newcomer_first": True} if mode == "mixed" else {})}
    worker = WorkerProcess(model, redis_url, queue, mode, workdir / f"{mode}.log", options)
    client = GenqClient(redis_url, queue=queue)
    client.settings = client.settings.model_copy(update={"tenant_lanes": lanes})
    flood_list = tenant_queue(queue, FLOOD, lanes)
    try:
        worker.start()
        worker.wait_ready(client.celery, timeout=300)
        timed_request(client, INTERACTIVE)  # the first request of a process pays for its setup
        if mode != "idle":
            for handle in client.submit_many([{"prompt": f"Flood request {i}: tell me a long story",
                                               "max_new_tokens": 8 + i % 17, "ignore_eos": True, "tenant": FLOOD}
                                              for i in range(args.flood)]):
                handle.close()
            while client.redis.llen(flood_list) > args.flood - args.concurrency:
                time.sleep(0.005)
        progress(f"{mode}: {args.interactive} interactive requests")
        timings = [timed_request(client, INTERACTIVE) for _ in range(args.interactive)]
        return timings, client.redis.llen(flood_list) if mode != "idle" else None
    finally:
        client.redis.delete(flood_list)
        client.close()
        worker.stop()


def mode_figures(mode: str, timings: list[tuple[float, float, float]], backlogs: list[int | None]
                 ) -> dict[str, Any]:
    figures = {"first_chunk_ms": percentiles_ms([t[0] for t in timings]),
               "engine_wait_ms": percentiles_ms([t[1] for t in timings]),
               "prefill_ms": percentiles_ms([t[2] for t in timings]),
               "first_chunk_all_ms": [round(t[0] * 1000, 1) for t in timings],
               "flood_queued_at_end": None if mode == "idle" else min(b for b in backlogs if b is not None)}
    progress(f"{mode}: {figures}")
    return figures


def plot(results: dict[str, Any], path: Path) -> None:
    modes = list(results["modes"])
    fig, axes = subplots(1, 2, (10, 4))
    colors = {"idle": "#999", "shared": "#c44", "mixed": "#d92", "lanes": "#2a7"}
    for i, mode in enumerate(modes):
        values = results["modes"][mode]["first_chunk_all_ms"]
        axes[0].scatter([i] * len(values), values, color=colors[mode], alpha=0.6)
    axes[0].set_xticks(range(len(modes)), modes)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms")
    axes[0].set_title("interactive tenant: time to first chunk, each request")
    lanes_modes = [m for m in modes if m != "shared"]
    bars = [(key, q) for key in ("first_chunk_ms", "prefill_ms") for q in ("p50", "p90", "p99")]
    width = 0.8 / len(bars)
    for i, (key, q) in enumerate(bars):
        label = f"{'first chunk' if key == 'first_chunk_ms' else 'of it its prefill step'} {q}"
        axes[1].bar([j + (i - (len(bars) - 1) / 2) * width for j in range(len(lanes_modes))],
                    [results["modes"][m][key][q] for m in lanes_modes], width, label=label)
    axes[1].set_xticks(range(len(lanes_modes)), lanes_modes)
    axes[1].set_ylabel("ms")
    axes[1].set_title("idle; flood with lanes (mixed / newcomer steps)")
    axes[1].legend(fontsize=7)
    s = results["settings"]
    fig.suptitle(f"{s['flood']} flood tasks, {s['interactive']} interactive requests x {s['rounds']} rounds, "
                 f"concurrency and batch "
                 f"{s['concurrency']}, {s['lanes']} lanes - {results['machine']['date']}", fontsize=9)
    save_figure(fig, path, dpi=100)


def markdown_table(results: dict[str, Any]) -> str:
    idle = results["modes"]["idle"]["first_chunk_ms"]
    rows = ["| mode | first chunk p50 / p90 / p99 | engine wait p50 / p99 | prefill step p50 / p99 | p50 / idle p50 | "
            "p90 / idle p90 | p99 / idle p99 | flood tasks still queued |", "|---|---|---|---|---|---|---|---|"]
    for mode, f in results["modes"].items():
        chunk = f["first_chunk_ms"]
        rows.append(f"| {mode} | {chunk['p50']:.0f} / {chunk['p90']:.0f} / {chunk['p99']:.0f} ms | "
                    f"{f['engine_wait_ms']['p50']:.1f} / {f['engine_wait_ms']['p99']:.1f} ms | "
                    f"{f['prefill_ms']['p50']:.1f} / {f['prefill_ms']['p99']:.1f} ms | "
                    + " | ".join(f"{chunk[q] / idle[q]:.1f}x" for q in ("p50", "p90", "p99"))
                    + f" | {f['flood_queued_at_end'] if mode != 'idle' else '-'} |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = start_run(1)
    model = ensure_model(args.preset)
    results: dict[str, Any] = {
        "machine": machine,
        "settings": {"flood": args.flood, "interactive": args.interactive, "rounds": args.rounds,
                     "concurrency": args.concurrency,
                     "lanes": args.lanes, "preset": args.preset, "flood_max_new_tokens": "8 + i % 17",
                     "interactive_max_new_tokens": 2},
        "timing": TIMING_METHOD,
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp, RedisServer(Path(tmp), persistence="none") as server:
        runs: dict[str, list[tuple[list[tuple[float, float, float]], int | None]]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode in MODES:
                progress(f"round {round_ + 1} of {args.rounds}")
                runs[mode].append(run_mode(mode, model, args, server.url, Path(tmp)))
    for mode in MODES:
        results["modes"][mode] = mode_figures(mode, [t for timings, _ in runs[mode] for t in timings],
                                              [backlog for _, backlog in runs[mode]])
    return results


main = bench_main("fairness", parse_args, run, plot, markdown_table)

if __name__ == "__main__":
    main()
