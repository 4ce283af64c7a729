"""The CPU decode attention of one layer at SmolLM2-135M's shapes, a decode step
after another: each step writes every row's new token (kernels.write_kv) and
attends (kernels.paged_attention), on a cache that keeps its gathered pages
between steps (kernels.keep_gathered, as the engine's cache does) against one
that gathers every row's pages afresh each call (the behaviour before). Issue
30, item 4: the KV page gather was 24% of a 32-job decode step.

Shapes: 9 query heads, 3 KV heads of 64, page size 16, fp32. N decoding rows
(32) with the contexts of bench/engine_throughput.py's workload midway through
decoding (prompt uniform in [16, 512] plus uniform [1, max_new_tokens] generated,
max_new_tokens uniform in [16, 256], random.Random(0)); each row's pages are
scattered over the cache, and a row takes a fresh page when it fills one.

Thread CPU time (time.thread_time) per layer call (write + attention) with one
torch thread, so that other sessions on a shared machine cost wall time but not
this figure; the two caches take turns, round by round (both at the same
contexts in each round), and each one's median round is reported. Every step's
outputs of the two are compared.

Writes <out>/decode_attention.{json,png} (decode_attention_quick.* with --quick)
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from bench_common import bar_chart, bench_main, bench_parser, start_run, table_lines

import kernels

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
SYSTEMS = ("fresh gather", "kept gather")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, "3 rounds of 5 calls (checks the script)", "The full run takes about a minute.")
    parser.add_argument("--rows", type=int, default=32, help="decoding rows in the batch (default 32)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds, the two caches taking turns (default 15)")
    parser.add_argument("--calls", type=int, default=20, help="decode steps per cache and round (default 20)")
    return parser.parse_args(argv)


def contexts(rows: int) -> list[int]:
    """Context lengths of `rows` requests of the throughput workload, midway through decoding."""
    rng = random.Random(0)
    out = []
    for _ in range(rows):
        prompt, max_new = rng.randint(16, 512), rng.randint(16, 256)
        out.append(prompt + rng.randint(1, max_new))
    return out


class Layer:
    """One layer's cache and the rows decoding over it, identical for both systems (same seed)."""

    def __init__(self, rows: int, steps: int, keep: bool) -> None:
        self.ctx = contexts(rows)
        final_pages = [-(-(c + steps) // PAGE_SIZE) for c in self.ctx]
        gen = torch.Generator().manual_seed(0)
        num_pages = rows * max(final_pages)
        self.k_cache = torch.randn(KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM, generator=gen)
        self.v_cache = torch.randn(KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM, generator=gen)
        self.table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(rows, -1)
        self.gen = gen
        self.cu_seqlens = torch.arange(rows + 1, dtype=torch.int32)
        if keep:
            kernels.keep_gathered(self.k_cache, self.v_cache)

    def step(self) -> torch.Tensor:
        """Write one new token per row, then attend: the decode step of one layer."""
        rows = len(self.ctx)
        slots = torch.tensor([int(self.table[b, c // PAGE_SIZE]) * PAGE_SIZE + c % PAGE_SIZE
                              for b, c in enumerate(self.ctx)])
        self.ctx = [c + 1 for c in self.ctx]
        k = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=self.gen)
        v = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=self.gen)
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=self.gen)
        kernels.write_kv(k, v, self.k_cache, self.v_cache, slots)
        width = -(-max(self.ctx) // PAGE_SIZE)
        return kernels.paged_attention(q, self.k_cache, self.v_cache, self.table[:, :width], self.cu_seqlens,
                                       torch.tensor(self.ctx, dtype=torch.int32), HEAD_DIM**-0.5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = start_run(1)
    rounds, calls = (3, 5) if args.quick else (args.rounds, args.calls)
    layers = {name: Layer(args.rows, rounds * calls + 1, keep=name == "kept gather") for name in SYSTEMS}
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    max_diff = 0.0
    with torch.inference_mode():
        for _ in range(rounds):
            outputs: dict[str, list[torch.Tensor]] = {name: [] for name in SYSTEMS}
            for name, layer in layers.items():
                start = time.thread_time()
                for _ in range(calls):
                    outputs[name].append(layer.step())
                times[name].append((time.thread_time() - start) / calls * 1e3)
            max_diff = max(max_diff, *(float((a - b).abs().max()) for a, b in zip(*outputs.values())))
    ctx = layers["kept gather"].ctx
    return {
        "machine": machine, "threads": 1, "rows": args.rows, "rounds": rounds, "calls": calls,
        "contexts_at_end": ctx, "kv_mib_at_end": round(2 * KV_HEADS * HEAD_DIM * 4 * sum(ctx) / 2**20, 2),
        "max_abs_diff": max_diff,
        "results": [{"system": name, "median_ms": round(statistics.median(times[name]), 3),
                     "min_ms": round(min(times[name]), 3), "rounds_ms": [round(t, 3) for t in times[name]]}
                    for name in SYSTEMS],
    }


def table(results: dict[str, Any]) -> str:
    base = results["results"][0]["median_ms"]
    rows = [(r["system"], f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}", f"{base / r['median_ms']:.2f}x")
            for r in results["results"]]
    load = results["machine"]["load_average_at_start"]
    return "\n".join([
        *table_lines(("decode attention", "median ms", "min ms", "speed-up"), "lrrr", rows),
        "",
        f"{results['rows']} decode rows ({results['kv_mib_at_end']} MiB of K/V at the end), thread CPU time per "
        f"layer call (write + attention), 1 thread; outputs differ by at most {results['max_abs_diff']:.1e}; "
        f"load average at start {load[0] if load else 'n/a'}",
    ])


def plot(results: dict[str, Any], path: Path) -> None:
    bar_chart(path, [r["system"] for r in results["results"]],
              {"median": [r["median_ms"] for r in results["results"]]}, "thread CPU ms per layer call",
              f"decode attention, {results['rows']} rows (SmolLM2-135M shapes)")


main = bench_main("decode_attention", parse_args, run, plot, table)

if __name__ == "__main__":
    main()
