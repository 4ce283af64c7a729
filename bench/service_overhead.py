"""Service overhead: the same workload through the engine alone and through the whole service.

One run measures, per model (random-weight llama presets, "tiny" by default),
the workload of engine_throughput.py (64 requests; 8 with --quick; prompt
lengths uniform in [16, 512] and max_new_tokens uniform in [16, 256] from
random.Random(0), prompt ids uniform over the non-special vocabulary; greedy;
EOS never stops a request) served two ways with the same cache, page size,
batch width, per-step token budget and torch thread count:

  engine   Generator.from_pretrained in this process: every request enqueued at
           once, then iterate() until done; a token's time is when the iterate()
           call that produced it returns (engine_throughput's run_engine).
  service  a private redis-server on a free port, a real `genq worker` subprocess
           (python -m worker.cli worker --concurrency 64, the same engine options;
           ready once it answers the `engine_stats` control command), and a plain
           Celery client that sends every request with
           send_task("genq.generate", kwargs={"input_ids": ..., "ignore_eos": true,
           "stream": {"include_token_ids": true}, ...}, queue=...). One redis
           pub/sub connection, subscribed to all the requests' channels before the
           first task is sent, stamps each event with perf_counter on arrival; a
           token's time is the arrival of the chunk event carrying it (token ids in
           the events make every token a chunk). The run ends with the last final
           event; the results are then read from the result backend.

Both paths get a short warm-up first. Metrics per path: generated tokens/s
(sum of max_new_tokens over the time from the first submit to the last token)
and first-chunk latency p50/p90/p99 (first token or chunk time minus the moment
the requests were submitted). The service/engine throughput ratio is the
headline (target >= 0.9). The paths schedule differently (the worker's requests
trickle in while the engine is already stepping), so per-request differences of
the all-at-once latencies mean nothing; the difference of the percentiles is
reported, and, to isolate the queue + Redis cost, N single requests (20; 5 with
--quick; max_new_tokens 8, prompts drawn like the workload's) go one at a time
through each path: submit to first token (engine) or first chunk arrival
(service), p50/p99, the difference of those and the median of the paired
per-request differences (target < 5 ms at the median).

Correctness: greedy, so the service's result texts and token ids must equal the
engine's full_completion and tokens, request by request (counts reported); the
streamed chunks must concatenate to the result. The worker's engine_stats before
and after the workload and at the end are included.

Writes <out>/service_overhead.json and .png (service_overhead_quick.* with
--quick) and prints a markdown table; progress goes to stderr. Needs
redis-server on the PATH; the worker and redis-server it starts are stopped on
exit, Ctrl-C or SIGTERM included.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import celery
import kombu
import redis
from bench_common import (
    available_cores,
    bench_parser,
    ensure_model,
    percentiles_ms,
    progress,
    start_run,
    write_results,
)
from celery import Celery
from engine_throughput import FULL_WORKLOAD, QUICK_WORKLOAD, WARMUP_WORKLOAD
from service_report import markdown_table, plot
from service_runners import (
    WORKER_CONCURRENCY,
    EngineSettings,
    engine_singles,
    install_sigterm_as_interrupt,
    run_service,
    service_singles,
)
from throughput_runners import Request, Trace, WorkloadSpec, make_workload, pages_needed, run_engine

from engine import Generator, Tokenizer
from genq_dev.tiny_model import PRESETS, count_parameters
from worker.processes import RedisServer, WorkerProcess

SINGLE_NEW_TOKENS = 8
SINGLE_SEED = 2
THROUGHPUT_TARGET = 0.9
SINGLE_ADDED_TARGET_MS = 5.0
TIMING_METHOD = {
    "start": "time.perf_counter() just before the first request is submitted (enqueue / send_task)",
    "engine": "a token's time is when the iterate() call that produced it returns",
    "service": "a token's time is when the chunk event carrying it arrives at the benchmark's pub/sub connection "
               "(subscribed to every channel before the first send_task; token ids requested in the events)",
    "wall": "from start until the last token (engine) or the last final event (service) is available",
    "first_chunk": "first token / first chunk time - start, per request; percentiles over requests",
    "single": "one request at a time, max_new_tokens 8: submit to first token / first chunk arrival; "
              "the service's channel is subscribed before the clock starts",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(
        __doc__,
        quick="smoke run: 8 requests (prompts 16-64, 8-32 new tokens) and 5 single requests; "
              "writes service_overhead_quick.{json,png}",
        epilog="The full run takes minutes on a small CPU: run it on a quiet machine; --quick is a smoke check.",
    )
    parser.add_argument(
        "--models", default="tiny", help=f"comma-separated llama presets out of {','.join(PRESETS)} (default tiny)"
    )
    parser.add_argument(
        "--threads", type=int, default=max(1, available_cores() - 1),
        help="torch threads of the in-process engine and of the worker (default: all cores but one, left to "
             "redis-server, the client and the worker's other threads: a busy core stalls every torch thread)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="KV page size (default 16)")
    parser.add_argument("--chunk-size", type=int, default=2048, help="engine max_chunk_size (default 2048)")
    parser.add_argument(
        "--singles", type=int, default=None, help="number of single requests per path (default 20; 5 with --quick)"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds to wait for a service run before giving up"
    )
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or any(m not in PRESETS for m in args.models):
        parser.error(f"--models: expected a comma-separated subset of {','.join(PRESETS)}")
    if args.singles is None:
        args.singles = 5 if args.quick else 20
    if args.singles < 1 or args.threads < 1:
        parser.error("--singles and --threads must be at least 1")
    return args


# -- scoring ------------------------------------------------------------------


def summarize(trace: Trace, requests: Sequence[Request]) -> dict[str, Any]:
    """Throughput and first-chunk latency of one path on the workload."""
    wall = trace.end - trace.start
    generated = sum(min(len(t), r.max_new_tokens) for t, r in zip(trace.tokens, requests))
    first = [times[0] - trace.start for times in trace.token_times if times]
    itl = [b - a for times in trace.token_times for a, b in zip(times, times[1:])]
    return {
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "complete": generated == sum(r.max_new_tokens for r in requests),
        "generated_tok_s": round(generated / wall, 2),
        "first_chunk_ms": percentiles_ms(first),
        "itl_ms": percentiles_ms(itl),
        "per_request_first_chunk_ms": [round(t * 1e3, 2) for t in first],
        "details": trace.details,
    }


def _difference(service: dict[str, float | None], engine: dict[str, float | None]) -> dict[str, float | None]:
    return {p: None if service[p] is None or engine[p] is None else round(service[p] - engine[p], 3)
            for p in service}


def single_summary(engine_s: Sequence[float], service_s: Sequence[float]) -> dict[str, Any]:
    """Both paths on identical single requests: the difference is the queue + Redis cost."""
    engine, service = percentiles_ms(engine_s), percentiles_ms(service_s)
    paired = statistics.median(s - e for s, e in zip(service_s, engine_s)) * 1e3
    return {
        "requests": len(engine_s),
        "max_new_tokens": SINGLE_NEW_TOKENS,
        "engine_ms": engine,
        "service_ms": service,
        "added_ms": _difference(service, engine),
        "paired_added_median_ms": round(paired, 3),
        "per_request_engine_ms": [round(t * 1e3, 3) for t in engine_s],
        "per_request_service_ms": [round(t * 1e3, 3) for t in service_s],
    }


def compare_outputs(engine: Trace, service: Trace, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Greedy: the service must produce the engine's tokens and text, and its
    stream must add up to its result."""
    requests = len(results)
    tokens = [i for i in range(requests) if engine.tokens[i] != results[i]["token_ids"]]
    texts = [i for i in range(requests) if engine.texts[i] != results[i]["text"]]
    streams = [i for i in range(requests)
               if service.texts[i] != results[i]["text"] or service.tokens[i] != results[i]["token_ids"]]
    return {
        "requests": requests,
        "tokens_equal": requests - len(tokens),
        "texts_equal": requests - len(texts),
        "streams_equal_results": requests - len(streams),
        "mismatched": {"tokens": tokens, "texts": texts, "streams": streams},
    }


# -- the two paths ----------------------------------------------------------------


def bench_engine(
    path: Path, engine: EngineSettings, requests: list[Request], warmup: list[Request], singles: list[Request]
) -> tuple[Trace, list[float]]:
    """The engine in this process: warm-up, the workload all at once, then the single requests."""
    gen = Generator.from_pretrained(path, **engine.generator_options())
    run_engine(gen, warmup)
    trace = run_engine(gen, requests)
    return trace, engine_singles(gen, singles)


def bench_service(
    path: Path, engine: EngineSettings, requests: list[Request], warmup: list[Request], singles: list[Request],
    args: argparse.Namespace, redis_url: str, workdir: Path, queue: str,
) -> tuple[Trace, list[dict[str, Any]], list[float], dict[str, Any]]:
    """Start a worker for this model, run warm-up, workload and singles through it, stop it."""
    client = Celery("bench-client", broker=redis_url, backend=redis_url)
    redis_client = redis.Redis.from_url(redis_url)
    try:
        # torch sizes its thread pool from OMP_NUM_THREADS: the same thread count as the in-process engine.
        options = {"concurrency": WORKER_CONCURRENCY, "shutdown_grace": 0, **engine.generator_options()}
        with WorkerProcess(path, redis_url, queue, f"bench-{queue}", workdir / f"{queue}.log", options,
                           env={"OMP_NUM_THREADS": str(args.threads)}) as worker:
            try:
                progress(f"{queue}: waiting for the worker to load its engine")
                worker.wait_ready(client, timeout=300)
                run_service(client, redis_client, warmup, queue, f"{queue}-warmup", args.timeout)
                stats = {"before_workload": worker.engine_stats(client)}
                progress(f"{queue}: service workload start")
                trace, results = run_service(client, redis_client, requests, queue, f"{queue}-w", args.timeout)
                stats["after_workload"] = worker.engine_stats(client)
                progress(f"{queue}: {len(singles)} single requests through the service")
                single_s = service_singles(client, redis_client, singles, queue, f"{queue}-s", args.timeout)
                stats["at_end"] = worker.engine_stats(client)
            except Exception:
                progress(f"{queue}: the service run failed; the worker's log ends with:\n{worker.log_tail()}")
                raise
    finally:
        redis_client.close()
        client.close()
    before, after = stats["before_workload"], stats["after_workload"]
    stats["workload_steps"] = after["steps"] - before["steps"] if before and after else None
    return trace, results, single_s, stats


# -- per model ----------------------------------------------------------------------


def bench_model(preset: str, spec: WorkloadSpec, args: argparse.Namespace, redis_url: str, workdir: Path
                ) -> dict[str, Any]:
    path = ensure_model(preset)
    config = json.loads((path / "config.json").read_text())
    special = Tokenizer.from_dir(path).special_token_ids
    requests = make_workload(spec, config["vocab_size"], special)
    warmup = make_workload(WARMUP_WORKLOAD, config["vocab_size"], special)
    single_spec = WorkloadSpec(args.singles, spec.prompt_len, (SINGLE_NEW_TOKENS, SINGLE_NEW_TOKENS), SINGLE_SEED)
    singles = make_workload(single_spec, config["vocab_size"], special)
    # A cache that holds every request at full length (no preemption) and a batch as wide as the workload.
    engine = EngineSettings(
        cache_tokens=pages_needed(requests, args.page_size) * args.page_size,
        page_size=args.page_size,
        max_batch_size=len(requests),
        max_chunk_size=args.chunk_size,
    )
    progress(f"{preset}: {len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt + "
             f"{sum(r.max_new_tokens for r in requests)} new tokens; engine alone: start")
    engine_trace, engine_single_s = bench_engine(path, engine, requests, warmup, singles)
    gc.collect()
    engine_run = summarize(engine_trace, requests)
    _log_run(preset, "engine alone", engine_run)
    service_trace, results, service_single_s, stats = bench_service(
        path, engine, requests, warmup, singles, args, redis_url, workdir, f"bench-{preset}"
    )
    service_run = summarize(service_trace, requests)
    _log_run(preset, "service", service_run)
    progress(f"{preset} worker: peak_active_jobs {stats['at_end']['peak_active_jobs']}, {stats['workload_steps']} "
             f"steps for the workload (engine alone {engine_trace.details['steps']})")
    singles_result = single_summary(engine_single_s, service_single_s)
    correctness = compare_outputs(engine_trace, service_trace, results)
    ratio = service_run["generated_tok_s"] / engine_run["generated_tok_s"]
    progress(
        f"{preset}: service/engine {ratio:.3f}; single first chunk p50 engine {singles_result['engine_ms']['p50']} "
        f"ms, service {singles_result['service_ms']['p50']} ms (paired median added "
        f"{singles_result['paired_added_median_ms']} ms); texts equal {correctness['texts_equal']}/"
        f"{correctness['requests']}"
    )
    return {
        "path": str(path),
        "parameters": count_parameters(config),
        "engine_settings": asdict(engine),
        "workload": {
            "prompt_tokens": [len(r.prompt) for r in requests],
            "max_new_tokens": [r.max_new_tokens for r in requests],
            "single_prompt_tokens": [len(r.prompt) for r in singles],
        },
        "engine": engine_run,
        "service": service_run,
        "overhead": {
            "throughput_ratio": round(ratio, 4),
            "throughput_target": THROUGHPUT_TARGET,
            "throughput_meets_target": ratio >= THROUGHPUT_TARGET,
            "added_first_chunk_ms": _difference(service_run["first_chunk_ms"], engine_run["first_chunk_ms"]),
            "single_added_target_ms": SINGLE_ADDED_TARGET_MS,
            "single_meets_target": singles_result["paired_added_median_ms"] < SINGLE_ADDED_TARGET_MS,
        },
        "single_requests": singles_result,
        "correctness": correctness,
        "worker_engine_stats": stats,
    }


def _log_run(model: str, name: str, summary: dict[str, Any]) -> None:
    progress(
        f"{model} {name}: {summary['generated_tok_s']:.1f} gen tok/s, first chunk p50 "
        f"{summary['first_chunk_ms']['p50']} ms / p99 {summary['first_chunk_ms']['p99']} ms, "
        f"wall {summary['wall_s']:.2f} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    install_sigterm_as_interrupt()
    machine = start_run(args.threads)
    spec = QUICK_WORKLOAD if args.quick else FULL_WORKLOAD
    results: dict[str, Any] = {
        "benchmark": "service_overhead",
        "machine": machine,
        "settings": {
            "quick": args.quick,
            **spec.settings(),
            "single_requests": args.singles,
            "single_max_new_tokens": SINGLE_NEW_TOKENS,
            "single_seed": SINGLE_SEED,
            "models": args.models,
            "threads": args.threads,
            "page_size": args.page_size,
            "chunk_size": args.chunk_size,
            "worker_concurrency": WORKER_CONCURRENCY,
            "dtype": "float32",
            "greedy": True,
            "eos": "ignored (engine: stop_conditions=[]; service: ignore_eos=true)",
        },
        "timing_method": TIMING_METHOD,
    }
    results["machine"].update(celery=celery.__version__, kombu=kombu.__version__, redis_py=redis.__version__)
    with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp, RedisServer(Path(tmp), persistence="none") as server:
        results["machine"]["redis_server"] = server.version
        progress(f"redis-server on port {server.port}")
        results["models"] = {preset: bench_model(preset, spec, args, server.url, Path(tmp)) for preset in args.models}
    write_results(results, args.out, "service_overhead", args.quick, plot, markdown_table)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        progress("interrupted; the worker and redis-server were stopped")
        sys.exit(130)
