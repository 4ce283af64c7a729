"""What do LoRA adapters cost the engine? (issue 28, item 4: target >= 0.8x the base model's
tokens/s with 16 distinct adapters.)

One generator of a tiny random llama model with 16 PEFT adapters registered (random A and B,
rank --rank on all seven projections, written by PEFT's save_pretrained). Each run enqueues 64
jobs at once (distinct 16-token prompts, greedy, --new-tokens tokens each, no stop) and times
them to the last token: the base model alone, then the jobs spread round-robin over 1, 4 and
16 adapters (one step mixes all of them: the grouped LoRA product per adapter). The runs
alternate, --repeats times, in one process; each point is the median tokens/s, reported with
its ratio to the base model's, and the median tokens per CPU second of the process (steadier
than the wall clock on a machine shared with other jobs) with its ratio. Memory per adapter is
LoraAdapter.num_bytes (the stacked A and placed B the engine keeps), next to the base model's
weight bytes; and the bytes of one adapter that a step with it reads (its A and B without the
placed B's zero blocks, as the stacked slots keep them) times 16 over the base model's: what a
16-adapter decode step reads besides the base weights, the ratio that sets the result when the
product runs at the memory's speed (`tiny`'s 16 adapters outweigh it; `medium`, a 1B model's
widths in 4 layers, has a real deployment's proportions).

Writes bench/results/lora.{json,png} (lora_<preset>.* for another --preset) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
from bench_common import (
    MODEL_CACHE,
    bench_parser,
    ensure_model,
    progress,
    save_figure,
    start_run,
    write_results,
)
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from engine import Generator, Job
from engine.lora import LoraAdapter

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_COUNTS = (1, 4, 16)
JOBS = 64
PROMPT_TOKENS = 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, "8 new tokens, one repeat; writes lora_quick.*", "about a minute on 2 cores")
    parser.add_argument("--preset", default="tiny",
                        help="tiny-model preset (default: tiny, ~5M parameters; medium: ~185M, a 1B model's widths)")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each job generates")
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of every configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return parser.parse_args(argv)


def make_adapters(base: Path, rank: int, count: int) -> list[Path]:
    """`count` PEFT adapters of `base` with random non-zero A and B, made once per (base, rank)."""
    root = MODEL_CACHE / f"{base.name}-lora-r{rank}"
    paths = [root / f"adapter{i}" for i in range(count)]
    missing = [i for i, path in enumerate(paths) if not (path / "adapter_model.safetensors").exists()]
    if missing:
        progress(f"making {len(missing)} PEFT adapters (rank {rank}) in {root}")
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        for i in missing:
            torch.manual_seed(i)
            peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                    init_lora_weights=False))
            peft.save_pretrained(paths[i])
            model = peft.unload()
    return paths


def read_bytes(adapter: LoraAdapter) -> int:
    """Bytes of the adapter a step running it reads: every A, and each targeted slice's block of B."""
    total = 0
    for key, (a, b) in adapter.weights.items():
        total += a.numel() * a.element_size()
        total += sum(part.rank * part.width for part in adapter.slices[key]) * b.element_size()
    return total


def timed_run(generator: Generator, adapters: int, new_tokens: int) -> tuple[float, float]:
    """Tokens/s and tokens per CPU second of JOBS jobs enqueued at once, spread round-robin over
    `adapters` adapters (0: base)."""
    for i in range(JOBS):
        prompt = [5 + (7 * i + 3 * j) % 250 for j in range(PROMPT_TOKENS)]
        generator.enqueue(Job(prompt, new_tokens, stop_conditions=[], identifier=i,
                              adapter=None if adapters == 0 else f"adapter{i % adapters}"))
    started, cpu_started = time.perf_counter(), time.process_time()
    generated = 0
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                generated += len(result.completion_ids or ())
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    assert generated == JOBS * new_tokens, "every job generates its tokens"
    return generated / elapsed, generated / cpu


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = start_run(args.threads)
    path = ensure_model(args.preset)
    new_tokens = 8 if args.quick else args.new_tokens
    repeats = 1 if args.quick else args.repeats
    generator = Generator.from_pretrained(path, cache_tokens=JOBS * (PROMPT_TOKENS + new_tokens + 16),
                                          max_batch_size=JOBS)
    adapters = [generator.adapters.register(f"adapter{i}", adapter)
                for i, adapter in enumerate(make_adapters(path, args.rank, max(ADAPTER_COUNTS)))]
    base_bytes = sum(t.numel() * t.element_size() for t in generator.model.parameters())
    configurations = (0, *ADAPTER_COUNTS)
    timed_run(generator, max(ADAPTER_COUNTS), 2)  # warm up every adapter's first product
    samples: dict[int, list[float]] = {count: [] for count in configurations}
    cpu_samples: dict[int, list[float]] = {count: [] for count in configurations}
    for repeat in range(repeats):
        for count in configurations:
            wall, cpu = timed_run(generator, count, new_tokens)
            samples[count].append(wall)
            cpu_samples[count].append(cpu)
            progress(f"repeat {repeat}: {count} adapter(s): {wall:.0f} tokens/s, {cpu:.0f} per CPU second")
    base = statistics.median(samples[0])
    cpu_base = statistics.median(cpu_samples[0])
    points = [{"adapters": count, "tokens_per_s": round(statistics.median(samples[count]), 1),
               "samples": [round(value, 1) for value in samples[count]],
               "ratio_to_base": round(statistics.median(samples[count]) / base, 3),
               "tokens_per_cpu_s": round(statistics.median(cpu_samples[count]), 1),
               "cpu_samples": [round(value, 1) for value in cpu_samples[count]],
               "cpu_ratio_to_base": round(statistics.median(cpu_samples[count]) / cpu_base, 3)}
              for count in configurations]
    return {
        "method": __doc__,
        "machine": machine,
        "threads": args.threads,
        "preset": args.preset,
        "rank": args.rank,
        "jobs": JOBS,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "points": points,
        "adapter_bytes": adapters[0].num_bytes,
        "adapter_read_bytes": read_bytes(adapters[0]),
        "base_weight_bytes": base_bytes,
        "adapters_16_read_over_base": round(max(ADAPTER_COUNTS) * read_bytes(adapters[0]) / base_bytes, 3),
        "target_met_at_16": points[-1]["ratio_to_base"] >= 0.8,
        "cpu_target_met_at_16": points[-1]["cpu_ratio_to_base"] >= 0.8,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Each configuration's ratio to the base model, by the wall clock and per CPU second side by side
    (on a shared machine the wall clock swings with the other jobs' load)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    points = results["points"]
    labels = ["base" if p["adapters"] == 0 else f"{p['adapters']} adapter(s)" for p in points]
    width = 0.38
    for shift, key, name, color in ((-width / 2, "ratio_to_base", "tokens/s", "tab:blue"),
                                    (width / 2, "cpu_ratio_to_base", "tokens per CPU second", "tab:green")):
        bars = ax.bar([i + shift for i in range(len(points))], [p[key] for p in points], width, label=name,
                      color=color)
        for bar, point in zip(bars, points, strict=True):
            ax.annotate(f"{point[key]:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(points)), labels)
    ax.axhline(0.8, color="tab:red", linestyle="--", label="0.8x base (target)")
    ax.set_ylabel("ratio to the base model (64 jobs)")
    ax.set_title(f"LoRA, {results['preset']} llama, rank {results['rank']}, {results['threads']} thread(s); "
                 f"16 adapters read {results['adapters_16_read_over_base']:.2f}x the base weights", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


def table(results: dict[str, Any]) -> str:
    lines = ["| adapters over 64 jobs | tokens/s | ratio to base | tokens per CPU s | CPU ratio to base |",
             "|---:|---:|---:|---:|---:|"]
    for p in results["points"]:
        lines.append(f"| {p['adapters'] or 'base'} | {p['tokens_per_s']:.0f} | {p['ratio_to_base']:.2f}x "
                     f"| {p['tokens_per_cpu_s']:.0f} | {p['cpu_ratio_to_base']:.2f}x |")
    mib = results["adapter_bytes"] / 2**20
    base_mib = results["base_weight_bytes"] / 2**20
    lines.append(f"\nmemory per adapter (rank {results['rank']}, 7 projections): {mib:.2f} MiB; "
                 f"read per step {results['adapter_read_bytes'] / 2**20:.2f} MiB; base weights {base_mib:.1f} MiB; "
                 f"16 adapters' reads / base weights: {results['adapters_16_read_over_base']:.2f}; "
                 f"target >= 0.8x at 16 adapters met: {results['target_met_at_16']} (tokens/s), "
                 f"{results['cpu_target_met_at_16']} (per CPU second)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    results = run(args)
    name = "lora" if args.preset == "tiny" else f"lora_{args.preset}"
    write_results(results, args.out, name, args.quick, plot, table)


if __name__ == "__main__":
    main()
