"""Does torch.compile make the CPU decode forward faster? (issue 10: keep
whichever is faster, with the measurement in docs/benchmarks.md.)

One tiny-model generator, N jobs decoding (16-token prompts, greedy, as in
host_overhead.py), the median forward time of a decode step measured twice in
one run: eager, then with the model's forward wrapped in
`torch.compile(dynamic=True)` (inductor's C++ backend on the CPU; the paged
attention's host-side grouping breaks the graph, so the layers' matmuls,
norms, RoPE and MLP are compiled between the breaks). The first compiled
steps' compile time is reported apart, and the greedy tokens of both are
compared.

Writes bench/results/decode_compile.{json,png} and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
from bench_common import (
    RESULTS_DIR,
    bench_main,
    ensure_model,
    progress,
    save_figure,
    start_run,
    table_lines,
)
from host_overhead import ForwardTimer, sampler_timer
from host_overhead import measure as measure_step

from engine import Generator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.engine_runs import greedy_completions  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BATCHES = (1, 16, 64)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="tiny-model preset (default: small, ~40M parameters)")
    parser.add_argument("--steps", type=int, default=30, help="measured decode steps per point")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps before measuring (compiles, if compiled)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 16, 8 steps; writes decode_compile_quick.*")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def measure_mode(gen: Generator, batches: Sequence[int], steps: int, warmup: int) -> list[dict[str, Any]]:
    timer = ForwardTimer(gen.model)
    sampler = sampler_timer(gen)
    points = []
    for jobs in batches:
        started = time.perf_counter()
        point = measure_step(gen, timer, sampler, jobs, "greedy", steps, warmup)
        point["point_wall_s"] = round(time.perf_counter() - started, 2)
        points.append(point)
        progress(f"  {jobs} jobs: forward {point['forward_ms']} ms (median), point took {point['point_wall_s']} s")
    return points


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = start_run(args.threads)
    path = ensure_model(args.preset)
    batches = BATCHES[:2] if args.quick else BATCHES
    steps = 8 if args.quick else args.steps
    cache_tokens = max(batches) * (16 + steps + args.warmup + 32)
    prompts = [[5 + (7 * i + j) % 200 for j in range(4 + 5 * i)] for i in range(4)]
    modes: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for mode in ("eager", "compiled"):
        gen = Generator.from_pretrained(path, cache_tokens=cache_tokens, max_batch_size=max(batches))
        compile_s = None
        if mode == "compiled":
            gen.model.forward = torch.compile(gen.model.forward, dynamic=True)
            started = time.perf_counter()
            tokens[mode] = greedy_completions(gen, prompts, 8)  # first calls compile
            compile_s = round(time.perf_counter() - started, 1)
            progress(f"compiled: the first generation (compiling) took {compile_s} s")
        else:
            tokens[mode] = greedy_completions(gen, prompts, 8)
        progress(f"{mode}:")
        modes[mode] = {"points": measure_mode(gen, batches, steps, args.warmup), "compile_s": compile_s}
    return {
        "method": __doc__,
        "machine": machine,
        "threads": args.threads,
        "preset": args.preset,
        "modes": modes,
        "greedy_tokens_equal": tokens["eager"] == tokens["compiled"],
    }


def plot(results: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, data in results["modes"].items():
        points = data["points"]
        ax.plot([p["jobs"] for p in points], [p["forward_ms"] for p in points], marker="o", label=mode)
    ax.set_xlabel("jobs decoding")
    ax.set_ylabel("median forward ms per decode step")
    ax.set_title(f"decode forward, {results['preset']} model, {results['threads']} thread(s)")
    ax.legend()
    save_figure(fig, path)


def table(results: dict[str, Any]) -> str:
    eager = {p["jobs"]: p for p in results["modes"]["eager"]["points"]}
    compiled = results["modes"]["compiled"]["points"]
    lines = table_lines(["jobs", "eager forward ms", "compiled forward ms", "compiled / eager"], "rrrr", [
        [p["jobs"], f"{eager[p['jobs']]['forward_ms']:.2f}", f"{p['forward_ms']:.2f}",
         f"{p['forward_ms'] / eager[p['jobs']]['forward_ms']:.2f}x"] for p in compiled])
    compile_s = results["modes"]["compiled"]["compile_s"]
    lines.append(f"\ncompile time {compile_s} s; greedy tokens equal: {results['greedy_tokens_equal']}")
    return "\n".join(lines)


main = bench_main("decode_compile", parse_args, run, plot, table)


if __name__ == "__main__":
    main()
