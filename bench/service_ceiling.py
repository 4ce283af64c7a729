"""Service ceiling: how many tokens/s one worker's service path carries, with the synthetic engine.

A GPU decodes thousands of tokens/s per worker; this machine's CPU cannot. The synthetic engine
(engine/synthetic.py, `genq worker --synthetic-rate R`) stands in for the GPU: it streams real
word tokens of the model's tokenizer at R tokens/s over its batch, each step a GIL-free wait of
jobs / R seconds, so everything else (Celery's task threads, tokenizing, the engine loop, the
output processor's text, publishing to Redis, Redis itself, the client) runs as it would beside
a GPU, on this machine's cores.

For each synthetic rate R (2,000, 5,000, 10,000, 20,000, 50,000 tokens/s; 2,000 and 20,000 with
--quick) one run starts a real `genq worker --synthetic-rate R --concurrency C --max-batch-size C`
(C = 64) on a private redis-server (no persistence), warms it with C short requests, then sends
enough requests of NEW_TOKENS (--new-tokens) tokens for about MEASURE_S seconds at R (at least 2 C of them) at
once with a plain Celery client (send_task, token ids in the chunk events); one pub/sub
connection follows every request's channel (bench/service_runners.py, as service_overhead.py).

Measured over the workload only (counters read before the first send and after the last result):
  engine tok/s    the same requests through the synthetic engine in this process, all enqueued at
                  once, C at a time: at most R (every token costs 1 / R of a step's wait whatever
                  the batch), less by the engine's own host work (the output processor's text)
  service tok/s   streamed tokens of the completed requests / wall time (first send to the last
                  final event); service/engine = that / engine tok/s (service/rate: that / R)
  CPU per 1,000 tokens, per component: the worker process (/proc/PID/stat utime + stime: Celery,
                  tokenizing, the engine loop, the output processor's text, publishing; not the
                  forward, which is a wait), redis-server (INFO cpu: used_cpu_user + used_cpu_sys),
                  the client (this process: time.process_time, the sends, the subscriber, the
                  results)
  Redis           commands per generated token (INFO commandstats, every command of every client),
                  the top commands, and network bytes in and out per token (INFO stats)
The highest rate whose service/engine is at least 0.95 is the headline.

Correctness: every request's streamed chunks concatenate to its result's text, and every text is
the same (the synthetic engine writes the same word cycle for every request).

Through the gateway (--streams, default 100,1000; 0 skips it): one worker at --sse-rate (default
10,000) with --concurrency the largest stream count, and two real `genq gateway`s in front of it,
one with SSE coalescing off and one at --sse-coalesce-ms (default 20; GENQ_GATEWAY_STREAM_COALESCE_MS).
For each stream count N, three runs back to back: coalescing off; the gateway's coalescing alone
(the worker publishes every step); the request's stream_options.coalesce_ms (the worker and the
gateway both). Each run sends N OpenAI streamed completions (POST /v1/completions, stream,
include_usage), N open at once, from --sse-clients client processes (bench/sse_client.py, each
after a warm-up round; bench/ceiling_sse.py says which limits 1,000 streams need raised); the same
figures, the gateway's CPU (/proc/PID/stat) added and the client processes' own, tokens counted
from each stream's usage chunk, plus the latency cost: time to each stream's first text and the
interval between its text chunks. Writes <out>/service_ceiling.json and .png
(service_ceiling_quick.* with --quick) and prints a markdown table. Needs redis-server on the PATH.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend
import redis  # noqa: E402
from bench_common import (  # noqa: E402
    bench_main,
    bench_parser,
    ensure_model,
    measured_when,
    percentiles_ms,
    progress,
    save_figure,
    start_run,
    table_lines,
)
from ceiling_sse import client_jobs, combined, raise_open_files_limit, run_clients, start_gateway  # noqa: E402
from celery import Celery  # noqa: E402
from service_runners import install_sigterm_as_interrupt, run_service  # noqa: E402
from throughput_runners import Request  # noqa: E402

from engine import EngineConfig, Job  # noqa: E402
from engine.synthetic import SyntheticGenerator  # noqa: E402
from worker.processes import RedisServer, WorkerProcess  # noqa: E402

RATES = (2000, 5000, 10000, 20000, 50000)
QUICK_RATES = (2000, 20000)
CONCURRENCY = 64
NEW_TOKENS = 128
PROMPT = list(range(1, 33))
MEASURE_S = 5.0
QUICK_MEASURE_S = 1.5
TARGET_RATIO = 0.95
QUEUE = "genq-ceiling"
TIMEOUT_S = 600.0
CLOCK_TICKS = 100  # os.sysconf("SC_CLK_TCK") on Linux
TOP_COMMANDS = 20
SSE_STREAMS = (100, 1000)
SSE_RATE = 10000
SSE_COALESCE_MS = 20
SSE_CLIENTS = 2
LATENCY_REQUESTS = 10
LATENCY_TOKENS = 512
"""The latency runs: one stream at a time, long enough to span several coalescing intervals."""
SSE_MODES = ("off", "gateway", "request")
"""Coalescing off; the gateway's alone (GENQ_GATEWAY_STREAM_COALESCE_MS); the request's
stream_options.coalesce_ms (the worker's and the gateway's)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, quick=f"rates {', '.join(map(str, QUICK_RATES))} only, about "
                                         f"{QUICK_MEASURE_S:g} s each; writes service_ceiling_quick.{{json,png}}",
                          epilog="About a minute per rate (worker start included); run it on a quiet machine.")
    parser.add_argument("--rates", default=None, help="comma-separated synthetic rates in tokens/s "
                                                      f"(default {','.join(map(str, RATES))}; none: the gateway "
                                                      "runs only)")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="requests in flight (the batch)")
    parser.add_argument("--streams", default=",".join(map(str, SSE_STREAMS)),
                        help="comma-separated counts of concurrent SSE streams through the gateway (default "
                             f"{','.join(map(str, SSE_STREAMS))}; 0 skips it)")
    parser.add_argument("--sse-coalesce-ms", type=int, default=SSE_COALESCE_MS,
                        help=f"the gateway runs' coalescing interval when on (default {SSE_COALESCE_MS})")
    parser.add_argument("--sse-clients", type=int, default=SSE_CLIENTS,
                        help=f"client processes the gateway runs' streams are shared over (default {SSE_CLIENTS})")
    parser.add_argument("--sse-rate", type=int, default=SSE_RATE,
                        help=f"the synthetic rate of the gateway run (default {SSE_RATE})")
    parser.add_argument("--coalesce-ms", type=int, default=0,
                        help="the workers' chunk coalescing interval (GENQ_STREAM_COALESCE_MS; default 0: a chunk "
                             "per step)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                        help=f"new tokens per request of the worker runs (default {NEW_TOKENS}): longer requests "
                             "spread each request's fixed commands and CPU (Celery's) over more tokens")
    args = parser.parse_args(argv)
    args.streams = tuple(count for count in map(int, args.streams.split(",")) if count)
    if args.rates is None:
        args.rates = QUICK_RATES if args.quick else RATES
    elif args.rates == "none":
        args.rates = ()
    else:
        args.rates = tuple(int(rate) for rate in args.rates.split(","))
    return args


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def redis_counters(client: redis.Redis) -> dict[str, Any]:
    cpu, stats = client.info("cpu"), client.info("stats")
    commands = {name.removeprefix("cmdstat_"): int(value["calls"])
                for name, value in client.info("commandstats").items()}
    return {"cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), "commands": commands,
            "net_in": int(stats["total_net_input_bytes"]), "net_out": int(stats["total_net_output_bytes"])}


def snapshot(worker_pid: int, client: redis.Redis, gateway_pid: int | None = None) -> dict[str, Any]:
    cpu = {"worker": process_cpu_s(worker_pid), "client": time.process_time()}
    if gateway_pid is not None:
        cpu["gateway"] = process_cpu_s(gateway_pid)
    return {"cpu_s": cpu, "redis": redis_counters(client)}


def usage(before: dict[str, Any], after: dict[str, Any], tokens: int, wall_s: float) -> dict[str, Any]:
    """Per-component CPU and Redis traffic between two snapshots, per 1,000 tokens and per token."""
    cpu = {name: value - before["cpu_s"][name] for name, value in after["cpu_s"].items()}
    cpu["redis"] = after["redis"]["cpu_s"] - before["redis"]["cpu_s"]
    calls = {name: count - before["redis"]["commands"].get(name, 0)
             for name, count in after["redis"]["commands"].items()}
    calls = {name: count for name, count in sorted(calls.items(), key=lambda item: -item[1]) if count}
    return {
        "cpu_s": {name: round(value, 3) for name, value in cpu.items()},
        "cpu_s_per_1k_tokens": {name: round(value / tokens * 1000, 4) for name, value in cpu.items()},
        "share_of_a_core": {name: round(value / wall_s, 3) for name, value in cpu.items()},
        "redis_commands_per_token": round(sum(calls.values()) / tokens, 3),
        "redis_top_commands_per_token": {name: round(count / tokens, 3)
                                         for name, count in list(calls.items())[:TOP_COMMANDS]},
        "redis_bytes_in_per_token": round((after["redis"]["net_in"] - before["redis"]["net_in"]) / tokens, 1),
        "redis_bytes_out_per_token": round((after["redis"]["net_out"] - before["redis"]["net_out"]) / tokens, 1),
    }


def engine_alone(rate: int, concurrency: int, count: int, new_tokens: int, model: Path) -> dict[str, Any]:
    """The same requests through the synthetic engine in this process, all enqueued at once, `concurrency`
    at a time: the engine's own rate, its host work (the output processor's text) included."""
    generator = SyntheticGenerator.from_model_dir(model, rate, EngineConfig().with_options(
        max_batch_size=concurrency, max_pending=count))
    generator.enqueue([Job(PROMPT, new_tokens, stop_conditions=[], identifier=i) for i in range(count)])
    start = time.perf_counter()
    while generator.num_remaining_jobs():
        generator.iterate()
    wall_s = time.perf_counter() - start
    tokens = generator.stats.generated_tokens
    return {"tokens": tokens, "wall_s": round(wall_s, 3), "tok_s": round(tokens / wall_s, 1),
            "forward_share": round(generator.forward_s / wall_s, 4)}


def measure_rate(rate: int, args: argparse.Namespace, model: Path, server: RedisServer, workdir: Path
                 ) -> dict[str, Any]:
    celery = Celery("bench-client", broker=server.url, backend=server.url)
    client = redis.Redis.from_url(server.url)
    options = {"synthetic_rate": rate, "concurrency": args.concurrency, "max_batch_size": args.concurrency,
               "stream_coalesce_ms": args.coalesce_ms}
    seconds = QUICK_MEASURE_S if args.quick else MEASURE_S
    count = max(2 * args.concurrency, round(rate * seconds / args.new_tokens))
    engine = engine_alone(rate, args.concurrency, count, args.new_tokens, model)
    progress(f"rate {rate}: the engine alone makes {engine['tok_s']:.0f} tokens/s")
    with WorkerProcess(model, server.url, QUEUE, f"ceiling-{rate}", workdir / f"worker-{rate}.log", options) as worker:
        worker.wait_ready(celery)
        assert worker.pid is not None
        run_service(celery, client, [Request(PROMPT, 8)] * args.concurrency, QUEUE, f"warm-{rate}", TIMEOUT_S)
        progress(f"rate {rate}: {count} requests of {args.new_tokens} tokens")
        before = snapshot(worker.pid, client)
        trace, results = run_service(celery, client, [Request(PROMPT, args.new_tokens)] * count, QUEUE, f"run-{rate}",
                                     TIMEOUT_S)
        after = snapshot(worker.pid, client)
    tokens = sum(len(ids) for ids in trace.tokens)
    wall_s = trace.end - trace.start
    texts = [result["text"] for result in results]
    service = tokens / wall_s
    progress(f"rate {rate}: {service:.0f} tokens/s at the client, x{service / engine['tok_s']:.3f} of the engine's")
    return {
        "synthetic_rate": rate, "requests": count, "new_tokens": args.new_tokens, "tokens": tokens, "engine": engine,
        "wall_s": round(wall_s, 3), "service_tok_s": round(service, 1),
        "service_over_engine": round(service / engine["tok_s"], 4), "service_over_rate": round(service / rate, 4),
        "streams_match_results": trace.texts == texts, "texts_alike": len(set(texts)) == 1,
        "completion_tokens_reported": sum(result["usage"]["completion_tokens"] for result in results),
        **usage(before, after, tokens, wall_s),
    }


def measure_sse_run(streams: int, mode: str, args: argparse.Namespace, worker_pid: int,
                    gateways: dict[int, tuple[int, str]], client: redis.Redis) -> dict[str, Any]:
    """One gateway run: 2 `streams` completions, `streams` at once, coalescing as `mode` says."""
    gateway_ms = args.sse_coalesce_ms if mode == "gateway" else 0
    gateway_pid, url = gateways[gateway_ms]
    request_ms = args.sse_coalesce_ms if mode == "request" else None
    jobs = client_jobs(url, streams, streams, NEW_TOKENS, args.sse_clients, request_ms)
    progress(f"gateway: {streams} streamed completions, {streams} at once, coalescing {mode}")

    def counters() -> dict[str, Any]:
        return snapshot(worker_pid, client, gateway_pid)

    before, reports, after = run_clients(jobs, counters)
    done = combined(reports, NEW_TOKENS)
    # The client's CPU is its processes' own (this process only waits): replace the snapshot's.
    before["cpu_s"]["client"], after["cpu_s"]["client"] = 0.0, done["cpu_s"]
    if done["failed"]:
        progress(f"gateway: {done['failed']} streams broke ({'; '.join(done['failures'])})")
    tokens = max(done["tokens"], 1)
    service = done["tokens"] / done["wall_s"]
    progress(f"gateway: {service:.0f} tokens/s at the client, x{service / args.sse_rate:.3f} of the synthetic rate")
    return {"streams": streams, "mode": mode, "gateway_coalesce_ms": gateway_ms, "request_coalesce_ms": request_ms,
            "client_processes": len(jobs), "requests": streams, "new_tokens": NEW_TOKENS,
            "tokens": done["tokens"], "completed": done["completed"], "failed": done["failed"],
            "failures": done["failures"], "texts_alike": done["texts_alike"],
            "wall_s": round(done["wall_s"], 3), "service_tok_s": round(service, 1),
            "service_over_rate": round(service / args.sse_rate, 4),
            "text_chunks_per_token": round(done["text_chunks"] / tokens, 4),
            "first_text_ms": percentiles_ms(done["first_text_s"]),
            "text_chunk_interval_ms": percentiles_ms(done["intervals_s"]),
            **usage(before, after, tokens, done["wall_s"])}


def measure_sse_latency(mode: str, args: argparse.Namespace, gateways: dict[int, tuple[int, str]]
                        ) -> dict[str, Any]:
    """The latency cost alone: LATENCY_REQUESTS streams one after the other, so that nothing but the
    coalescing sets when a chunk goes out."""
    gateway_ms = args.sse_coalesce_ms if mode == "gateway" else 0
    request_ms = args.sse_coalesce_ms if mode == "request" else None
    jobs = client_jobs(gateways[gateway_ms][1], 1, LATENCY_REQUESTS, LATENCY_TOKENS, 1, request_ms)
    _, reports, _ = run_clients(jobs, lambda: None)
    done = combined(reports, LATENCY_TOKENS)
    progress(f"gateway: one stream at a time, coalescing {mode}: first text "
             f"{percentiles_ms(done['first_text_s'])['p50']} ms, chunks "
             f"{percentiles_ms(done['intervals_s'])['p50']} ms apart (p50)")
    return {"mode": mode, "requests": LATENCY_REQUESTS, "new_tokens": LATENCY_TOKENS,
            "completed": done["completed"], "texts_alike": done["texts_alike"],
            "tokens_per_text_chunk": round(done["tokens"] / max(done["text_chunks"], 1), 2),
            "first_text_ms": percentiles_ms(done["first_text_s"]),
            "text_chunk_interval_ms": percentiles_ms(done["intervals_s"])}


def measure_sse(args: argparse.Namespace, model: Path, server: RedisServer, workdir: Path) -> dict[str, Any]:
    """Every gateway run, on one worker and two gateways (coalescing off, and at --sse-coalesce-ms)."""
    celery = Celery("bench-client", broker=server.url, backend=server.url)
    client = redis.Redis.from_url(server.url)
    most, rate = max(args.streams), args.sse_rate
    options = {"synthetic_rate": rate, "concurrency": most, "max_batch_size": most,
               "stream_coalesce_ms": args.coalesce_ms}
    gateways: dict[int, tuple[int, str]] = {}
    processes = []
    try:
        for coalesce_ms in (0, args.sse_coalesce_ms):
            gateway, url = start_gateway(server.url, QUEUE, most, coalesce_ms, workdir / f"gateway-{coalesce_ms}.log")
            processes.append(gateway)
            assert gateway.pid is not None
            gateways[coalesce_ms] = (gateway.pid, url)
        with WorkerProcess(model, server.url, QUEUE, "ceiling-sse", workdir / "worker-sse.log", options) as worker:
            worker.wait_ready(celery)
            assert worker.pid is not None
            latency = [measure_sse_latency(mode, args, gateways) for mode in SSE_MODES]
            runs = [measure_sse_run(streams, mode, args, worker.pid, gateways, client)
                    for streams in args.streams for mode in SSE_MODES]
    finally:
        for process in processes:
            process.stop()
    return {"synthetic_rate": rate, "coalesce_ms": args.sse_coalesce_ms, "worker_coalesce_ms": args.coalesce_ms,
            "latency": latency, "runs": runs}


def run(args: argparse.Namespace) -> dict[str, Any]:
    install_sigterm_as_interrupt()
    machine = start_run(1)
    open_files = raise_open_files_limit()
    model = ensure_model("tiny")
    runs = []
    with tempfile.TemporaryDirectory(prefix="genq-ceiling-") as tmp, \
            RedisServer(Path(tmp), persistence="none") as server:
        for rate in args.rates:
            runs.append(measure_rate(rate, args, model, server, Path(tmp)))
        sse = measure_sse(args, model, server, Path(tmp)) if args.streams else None
        redis_version = server.version
    sustained = [r["synthetic_rate"] for r in runs if r["service_over_engine"] >= TARGET_RATIO]
    return {
        "benchmark": "service_ceiling", "machine": machine, "redis_version": redis_version,
        "model": "llama tiny preset (its tokenizer and config only: genq_dev/tiny_model.py)",
        "concurrency": args.concurrency, "coalesce_ms": args.coalesce_ms, "new_tokens": args.new_tokens,
        "target_ratio": TARGET_RATIO,
        "runs": runs, "gateway": sse, "open_files_limit": open_files,
        "highest_sustained_rate": max(sustained) if sustained else None,
    }


def markdown_table(results: dict[str, Any]) -> str:
    rows = []
    for r in results["runs"]:
        per_1k, share = r["cpu_s_per_1k_tokens"], r["share_of_a_core"]
        rows.append([f"{r['synthetic_rate']:,}", f"{r['engine']['tok_s']:,.0f}", f"{r['service_tok_s']:,.0f}",
                     f"{r['service_over_engine']:.3f}",
                     f"{per_1k['worker']:.3f} ({share['worker']:.0%})", f"{per_1k['redis']:.3f} ({share['redis']:.0%})",
                     f"{per_1k['client']:.3f} ({share['client']:.0%})", f"{r['redis_commands_per_token']:.2f}",
                     f"{r['redis_bytes_in_per_token']:.0f} / {r['redis_bytes_out_per_token']:.0f}"])
    header = ["synthetic tok/s", "engine alone tok/s", "service tok/s", "service/engine", "worker CPU s/1k tok (core)",
              "Redis CPU s/1k tok (core)", "client CPU s/1k tok (core)", "Redis cmds/token",
              "Redis bytes in/out per token"]
    sustained = results["highest_sustained_rate"]
    note = (f"\nHighest rate sustained at service/engine >= {results['target_ratio']}: "
            f"{'none' if sustained is None else f'{sustained:,} tokens/s'} ({results['concurrency']} requests in "
            f"flight; {measured_when(results['machine'])})")
    lines = [*table_lines(header, "rrrrrrrrr", rows), note]
    if results["gateway"] is not None:
        lines += ["", *sse_table_lines(results["gateway"], results["open_files_limit"])]
    return "\n".join(lines)


SSE_MODE_LABELS = {"off": "off", "gateway": "gateway {ms} ms", "request": "request {ms} ms (worker + gateway)"}


def sse_table_lines(sse: dict[str, Any], open_files: dict[str, int]) -> list[str]:
    """The gateway runs' table: per stream count, coalescing off, the gateway's alone, the request's."""
    rows = []
    for r in sse["runs"]:
        per_1k, share = r["cpu_s_per_1k_tokens"], r["share_of_a_core"]
        cells = [f"{per_1k[name]:.3f} ({share[name]:.0%})" for name in ("worker", "gateway", "redis", "client")]
        first, interval = r["first_text_ms"], r["text_chunk_interval_ms"]
        rows.append([f"{r['streams']:,}", SSE_MODE_LABELS[r["mode"]].format(ms=sse["coalesce_ms"]),
                     f"{r['service_tok_s']:,.0f}", f"{r['service_over_rate']:.3f}", *cells,
                     f"{r['redis_commands_per_token']:.2f}", f"{1 / max(r['text_chunks_per_token'], 1e-9):.1f}",
                     f"{first['p50']:.0f} / {first['p99']:.0f}", f"{interval['p50']:.1f} / {interval['p90']:.1f}",
                     f"{r['failed']}"])
    header = ["SSE streams", "coalescing", "service tok/s", "service/rate", "worker CPU s/1k tok (core)", "gateway",
              "Redis", "client", "Redis cmds/token", "tokens per SSE chunk", "first text ms p50 / p99",
              "text chunk interval ms p50 / p90", "failed"]
    note = (f"\nSynthetic rate {sse['synthetic_rate']:,} tokens/s, one worker, as many completions as streams, of "
            f"{NEW_TOKENS} tokens per run, the client in {sse['runs'][0]['client_processes']} processes; "
            f"RLIMIT_NOFILE {open_files['soft']:,}.")
    latency_rows = [[SSE_MODE_LABELS[r["mode"]].format(ms=sse["coalesce_ms"]), f"{r['tokens_per_text_chunk']:.1f}",
                     " / ".join(f"{r['first_text_ms'][q]:.1f}" for q in ("p50", "p99")),
                     " / ".join(f"{r['text_chunk_interval_ms'][q]:.1f}" for q in ("p50", "p90", "p99"))]
                    for r in sse["latency"]]
    latency_note = (f"\nOne stream at a time: {LATENCY_REQUESTS} completions of {LATENCY_TOKENS} tokens per "
                    "setting, time from sending the request to each chunk with text.")
    return [*table_lines(header, "rlrrrrrrrrrrr", rows), note, "",
            *table_lines(["coalescing", "tokens per SSE chunk", "first text ms p50 / p99",
                          "text chunk interval ms p50 / p90 / p99"], "lrrr", latency_rows), latency_note]


def plot(results: dict[str, Any], path: Path) -> None:
    runs = results["runs"]
    rates = [r["synthetic_rate"] for r in runs]
    fig, (left, middle, right, gateway) = plt.subplots(1, 4, figsize=(21, 4.5))
    left.plot(rates, [r["service_tok_s"] for r in runs], "o-", label="service (at the client)")
    left.plot(rates, rates, "--", color="gray", label="synthetic rate")
    left.plot(rates, [r["engine"]["tok_s"] for r in runs], "^-", color="C2", label="engine alone (in-process)")
    for r in runs:
        left.annotate(f"x{r['service_over_engine']:.2f}", (r["synthetic_rate"], r["service_tok_s"]), fontsize=8,
                      textcoords="offset points", xytext=(4, -10))
    left.set(xscale="log", yscale="log", xlabel="synthetic engine tokens/s", ylabel="tokens/s",
             title="one worker's service throughput")
    labels = [f"{rate:,}" for rate in rates]
    left.set_xticks(rates, labels)
    left.set_yticks(rates, labels)
    left.minorticks_off()
    left.legend()
    bottom = [0.0] * len(runs)
    for component in ("worker", "redis", "client"):
        values = [r["cpu_s_per_1k_tokens"][component] for r in runs]
        middle.bar(labels, values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values)]
    middle.set(xlabel="synthetic engine tokens/s", ylabel="CPU seconds per 1,000 tokens",
               title="CPU per component")
    middle.legend()
    right.bar(labels, [r["redis_commands_per_token"] for r in runs])
    right.set(xlabel="synthetic engine tokens/s", ylabel="Redis commands per generated token",
              title="Redis commands per token")
    if results["gateway"] is not None:
        plot_sse(results["gateway"], gateway)
    save_figure(fig, path)


def plot_sse(sse: dict[str, Any], axes: Any) -> None:
    """The gateway runs: CPU per 1,000 tokens per component, stacked, each bar labelled with its
    service tok/s."""
    runs = sse["runs"]
    labels = [f"{r['streams']:,}\n{r['mode']}" for r in runs]
    bottom = [0.0] * len(runs)
    for component in ("worker", "gateway", "redis", "client"):
        values = [r["cpu_s_per_1k_tokens"][component] for r in runs]
        axes.bar(labels, values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, (r, top) in enumerate(zip(runs, bottom)):
        axes.annotate(f"{r['service_tok_s']:,.0f} tok/s", (x, top), ha="center", fontsize=8,
                      textcoords="offset points", xytext=(0, 3))
    axes.set(xlabel=f"SSE streams, coalescing (on: {sse['coalesce_ms']} ms)", ylabel="CPU seconds per 1,000 tokens",
             title=f"through the gateway at {sse['synthetic_rate']:,} tok/s")
    axes.legend()


main = bench_main("service_ceiling", parse_args, run, plot, markdown_table)

if __name__ == "__main__":
    main()
