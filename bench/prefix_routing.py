"""Prefix-aware routing: prefix-cache hit rate and prompt work with and without it.

One run starts a private redis-server and, per mode, --workers real `genq
worker` subprocesses on one queue (tiny random-weight llama, the same cache
size each), then sends one workload through a GenqClient:

  --groups groups of --per-group requests; every request of a group starts
  with the group's system prompt (--system-chars characters of text, distinct
  from the first word on) followed by a short distinct question; greedy,
  --max-new-tokens tokens, EOS ignored; all requests sent at once in an order
  shuffled by random.Random(0).

  shared   every worker consumes the one queue (the default deployment).
  routed   GENQ_PREFIX_ROUTES = --workers, worker i also consumes route i, and
           the client routes each request by its first 256 characters.

Per mode: the prefix hit rate (prompt tokens served from the workers' prefix
caches over all prompt tokens, from each worker's engine_stats before and
after the workload), the prompt tokens computed, how many requests each
worker served, and the wall time from the first send to the last result. The
cache holds about half of all the groups' system prompts, so on a shared queue
each worker also evicts prefixes it will need again.

    python bench/prefix_routing.py            # 2 workers, 8 groups x 12 requests
    python bench/prefix_routing.py --quick    # 2 workers, 4 groups x 6 requests
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_common import (
    ensure_model,
    machine_info,
    progress,
    save_figure,
    subplots,
    table_lines,
    warn_if_busy,
    write_results,
)

from producer.client import GenqClient
from worker.processes import RedisServer, WorkerProcess

TIMING_METHOD = "wall: time.perf_counter() from the first submit to the last result read"
QUESTIONS = ("What changed?", "Who owns this?", "Is it safe to retry?", "What is the limit?",
             "Where are the logs?", "How do I roll back?", "Which alert fired?", "What does this error mean?")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--per-group", type=int, default=12, help="requests per system prompt")
    parser.add_argument("--system-chars", type=int, default=1500, help="length of each system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--preset", default="tiny", help="tiny model preset (genq_dev/tiny_model.py)")
    parser.add_argument("--cache-tokens", type=int, default=None,
                        help="KV cache per worker (default: about half of all the system prompts' tokens)")
    parser.add_argument("--quick", action="store_true", help="4 groups x 6 requests")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.groups, args.per_group = 4, 6
    return args


def system_prompt(group: int, chars: int) -> str:
    head = f"Team {group} assistant. You answer questions about service {group * 7919 % 1000} only. "
    body = " ".join(f"Rule {group}.{i}: check the runbook section {i} before you answer." for i in range(chars // 40))
    return (head + body)[:chars]


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    requests = [
        {"prompt": system_prompt(g, args.system_chars) + f"\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]}",
         "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
        for g in range(args.groups) for i in range(args.per_group)
    ]
    random.Random(0).shuffle(requests)
    return requests


def run_mode(mode: str, model: Path, args: argparse.Namespace, redis_url: str, workdir: Path,
             cache_tokens: int) -> dict[str, Any]:
    queue = f"bench-routing-{mode}"
    routed = mode == "routed"
    workers = []
    for i in range(args.workers):
        options: dict[str, Any] = {"cache_tokens": cache_tokens, "page_size": 16, "concurrency": 64,
                                   "shutdown_grace": 0}
        if routed:
            options.update(prefix_routes=args.workers, prefix_route=i)
        workers.append(WorkerProcess(model, redis_url, queue, f"{mode}{i}", workdir / f"{mode}{i}.log", options))
    client = GenqClient(redis_url, queue=queue)
    if routed:
        client.settings = client.settings.model_copy(update={"prefix_routes": args.workers})
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            progress(f"{mode}: waiting for {worker.node}")
            worker.wait_ready(client.celery, timeout=300)
        before = [worker.engine_stats(client.celery) for worker in workers]
        requests = workload(args)
        progress(f"{mode}: sending {len(requests)} requests")
        start = time.perf_counter()
        handles = [client.submit(request) for request in requests]
        for handle in handles:
            handle.result(timeout=args.timeout)
        wall = time.perf_counter() - start
        after = [worker.engine_stats(client.celery) for worker in workers]
    finally:
        client.close()
        for worker in workers:
            worker.stop()
    cached = sum(a["prompt_tokens_cached"] - b["prompt_tokens_cached"] for a, b in zip(after, before, strict=True))
    computed = sum(a["prompt_tokens_computed"] - b["prompt_tokens_computed"]
                   for a, b in zip(after, before, strict=True))
    served = [(a["generated_tokens"] - b["generated_tokens"]) // args.max_new_tokens
              for a, b in zip(after, before, strict=True)]
    figures = {"prefix_hit_rate": round(cached / (cached + computed), 4), "prompt_tokens_cached": cached,
               "prompt_tokens_computed": computed, "requests_per_worker": served, "wall_s": round(wall, 2)}
    progress(f"{mode}: {figures}")
    return figures


def plot(results: dict[str, Any], path: Path) -> None:
    modes = list(results["modes"])
    fig, axes = subplots(1, 2, (10, 4))
    axes[0].bar(modes, [results["modes"][m]["prefix_hit_rate"] for m in modes], color=["#999", "#2a7"])
    axes[0].set_ylim(0, 1)
    axes[0].set_title("prefix cache hit rate (higher is better)")
    axes[1].bar(modes, [results["modes"][m]["prompt_tokens_computed"] for m in modes], color=["#999", "#2a7"])
    axes[1].set_title("prompt tokens computed (lower is better)")
    s = results["settings"]
    fig.suptitle(f"{s['workers']} workers, {s['groups']} system prompts x {s['per_group']} requests, "
                 f"cache {s['cache_tokens']} tokens/worker - {results['machine']['date']}", fontsize=9)
    save_figure(fig, path, dpi=100)


def markdown_table(results: dict[str, Any]) -> str:
    return "\n".join(table_lines(
        ["mode", "prefix hit rate", "prompt tokens computed", "requests per worker", "wall"], "lllll",
        [[mode, f"{f['prefix_hit_rate']:.1%}", f["prompt_tokens_computed"],
          " / ".join(map(str, f["requests_per_worker"])), f"{f['wall_s']:.1f} s"]
         for mode, f in results["modes"].items()]))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warn_if_busy(1)
    model = ensure_model(args.preset)
    from engine import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model)
    prompt_tokens = [len(tokenizer.encode(system_prompt(g, args.system_chars))) for g in range(args.groups)]
    cache_tokens = args.cache_tokens or max(2048, sum(prompt_tokens) // 2)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "settings": {"workers": args.workers, "groups": args.groups, "per_group": args.per_group,
                     "system_chars": args.system_chars, "system_prompt_tokens": prompt_tokens,
                     "max_new_tokens": args.max_new_tokens, "preset": args.preset, "cache_tokens": cache_tokens,
                     "route_chars": 256},
        "timing": TIMING_METHOD,
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp, RedisServer(Path(tmp), persistence="none") as server:
        for mode in ("shared", "routed"):
            results["modes"][mode] = run_mode(mode, model, args, server.url, Path(tmp), cache_tokens)
    write_results(results, args.out, "prefix_routing", args.quick, plot, markdown_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
