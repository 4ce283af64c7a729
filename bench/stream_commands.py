"""Redis commands and bytes per generated token, with and without chunk coalescing (issue 30).

One run starts a private redis-server (no persistence) and, per mode, one real `genq worker` of the
tiny random-weight llama (--concurrency and batch 32) whose default coalescing is the mode's
(GENQ_STREAM_COALESCE_MS / GENQ_STREAM_COALESCE_TOKENS):
  every-step  0 ms, 0 tokens: a chunk event per job per engine step, as before issue 30
  20ms        a job's chunks merged and published at most every 20 ms
  200ms       at most every 200 ms
  5-tokens    every 5 tokens
After one warm-up request, `CONFIG RESETSTAT`, then --requests requests (--tokens new tokens each,
EOS ignored) sent at once with a plain Celery client; once every result is in, `INFO
commandstats` and `INFO stats`. Reported per generated token: the stream's commands (PUBLISH,
XADD, EXPIRE: what the publisher sends per event), all commands the server ran (Celery's broker
and result backend too), the stream's payload bytes (each event's JSON, sent twice: PUBLISH and
XADD) and the server's network input bytes; and the chunk events per request. The latency
cost: one pub/sub connection, subscribed to the mode's channels before the first send, stamps
each event on arrival (time.perf_counter): the first chunk's arrival from the burst's start
(p50/p99) and the gaps between a request's consecutive chunks (p50/p90). The engine of this
CPU makes tokens at a few hundred per second per job batch, far below a GPU's rate: at a GPU's
rate every interval holds more tokens, so the coalesced figures here are upper bounds.

    python bench/stream_commands.py            # 32 requests of 128 tokens per mode
    python bench/stream_commands.py --quick    # 8 requests of 32 tokens per mode
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from bench_common import (
    bench_main,
    bench_parser,
    ensure_model,
    percentiles_ms,
    progress,
    start_run,
    table_lines,
)
from celery import Celery

from producer.protocol import STREAM_FIELD, TASK_NAME, channel_name, stream_key
from worker.processes import RedisServer, WorkerProcess

MODES = {"every-step": (0, 0), "20ms": (20, 0), "200ms": (200, 0), "5-tokens": (0, 5)}
"""Mode -> the worker's (GENQ_STREAM_COALESCE_MS, GENQ_STREAM_COALESCE_TOKENS)."""
STREAM_COMMANDS = ("publish", "xadd", "expire")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, "8 requests of 32 tokens; writes stream_commands_quick.{json,png}",
                          "Four modes, each with its own worker; a minute or two.")
    parser.add_argument("--requests", type=int, default=32, help="requests sent at once (the worker's batch)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--preset", default="tiny", help="tiny model preset (genq_dev/tiny_model.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.tokens = 8, 32
    return args


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT ("cmdstat_xadd" -> "xadd")."""
    return {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in
            client.info("commandstats").items()}


class ChunkClock:
    """Stamps the chunk events of every channel matching `pattern` as they arrive, on a thread."""

    def __init__(self, client: redis.Redis, pattern: str) -> None:
        self.arrivals: defaultdict[str, list[float]] = defaultdict(list)
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(pattern)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message is not None and b'"event":"chunk"' in message["data"]:
                self.arrivals[message["channel"].decode()].append(time.perf_counter())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pubsub.close()


def run_mode(mode: str, model: Path, args: argparse.Namespace, redis_url: str, workdir: Path) -> dict[str, Any]:
    interval_ms, tokens = MODES[mode]
    queue = f"bench-stream-{mode}"
    options = {"cache_tokens": 16384, "page_size": 16, "concurrency": args.requests, "max_batch_size": args.requests,
               "stream_coalesce_ms": interval_ms, "stream_coalesce_tokens": tokens, "shutdown_grace": 0}
    worker = WorkerProcess(model, redis_url, queue, mode, workdir / f"{mode}.log", options)
    celery = Celery("bench", broker=redis_url, backend=redis_url)
    client = redis.Redis.from_url(redis_url)

    def send(identifier: str) -> Any:
        return celery.send_task(TASK_NAME, queue=queue, kwargs={
            "prompt": f"Request {identifier}: tell me a long story", "max_new_tokens": args.tokens,
            "ignore_eos": True, "identifier": identifier})

    try:
        worker.start()
        worker.wait_ready(celery, timeout=300)
        send(f"{mode}-warmup").get(timeout=300)
        clock = ChunkClock(client, channel_name(f"{mode}-x").removesuffix("x") + "*")
        client.config_resetstat()
        net_before = int(client.info("stats")["total_net_input_bytes"])
        began = time.perf_counter()
        handles = [send(f"{mode}-{i}") for i in range(args.requests)]
        results = [handle.get(timeout=600) for handle in handles]
        elapsed = time.perf_counter() - began
        clock.stop()
        calls = command_calls(client)
        net_bytes = int(client.info("stats")["total_net_input_bytes"]) - net_before
        streams = [client.xrange(stream_key(f"{mode}-{i}")) for i in range(args.requests)]
    finally:
        client.close()
        worker.stop()
    generated = sum(result["usage"]["completion_tokens"] for result in results)
    chunks = [sum(b'"event":"chunk"' in fields[STREAM_FIELD.encode()] for _, fields in entries)
              for entries in streams]
    payload = sum(len(fields[STREAM_FIELD.encode()]) for entries in streams for _, fields in entries)
    figures = {
        "coalesce_ms": interval_ms, "coalesce_tokens": tokens, "generated_tokens": generated,
        "tokens_per_s": round(generated / elapsed, 1),
        "stream_commands_per_token": round(sum(calls.get(c, 0) for c in STREAM_COMMANDS) / generated, 3),
        "all_commands_per_token": round(sum(calls.values()) / generated, 3),
        "stream_bytes_per_token": round(2 * payload / generated, 1),
        "net_input_bytes_per_token": round(net_bytes / generated, 1),
        "chunk_events_per_request": round(sum(chunks) / len(chunks), 1),
        "first_chunk_ms": percentiles_ms([times[0] - began for times in clock.arrivals.values()], (50, 99)),
        "inter_chunk_ms": percentiles_ms([b - a for times in clock.arrivals.values() for a, b in zip(times, times[1:])],
                                         (50, 90)),
        "commands": dict(sorted(calls.items(), key=lambda item: -item[1])),
    }
    progress(f"{mode}: { {k: v for k, v in figures.items() if k != 'commands'} }")
    return figures


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from bench_common import bar_chart

    modes = list(results["modes"])
    bar_chart(path, modes, {"stream commands / token": [results["modes"][m]["stream_commands_per_token"]
                                                         for m in modes],
                            "all commands / token": [results["modes"][m]["all_commands_per_token"] for m in modes]},
              "Redis commands per generated token",
              f"{results['settings']['requests']} requests x {results['settings']['tokens']} tokens, tiny model")


def markdown_table(results: dict[str, Any]) -> str:
    return "\n".join(table_lines(
        ["mode", "tokens/s", "stream commands / token", "all commands / token", "stream bytes / token",
         "net input bytes / token", "chunk events / request", "first chunk p50 / p99 (ms)",
         "between chunks p50 / p90 (ms)"], "lrrrrrrrr",
        [[mode, m["tokens_per_s"], m["stream_commands_per_token"], m["all_commands_per_token"],
          m["stream_bytes_per_token"], m["net_input_bytes_per_token"], m["chunk_events_per_request"],
          f"{m['first_chunk_ms']['p50']:.0f} / {m['first_chunk_ms']['p99']:.0f}",
          f"{m['inter_chunk_ms']['p50']:.0f} / {m['inter_chunk_ms']['p90']:.0f}"]
         for mode, m in results["modes"].items()]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = start_run(1)
    model = ensure_model(args.preset)
    results: dict[str, Any] = {"method": __doc__, "machine": machine,
                               "settings": {"requests": args.requests, "tokens": args.tokens, "preset": args.preset},
                               "modes": {}}
    with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp, RedisServer(Path(tmp), persistence="none") as server:
        for mode in MODES:
            results["modes"][mode] = run_mode(mode, model, args, server.url, Path(tmp))
    return results


main = bench_main("stream_commands", parse_args, run, plot, markdown_table)

if __name__ == "__main__":
    main()
