"""Multimodal jobs: throughput with an image per job against text only, and the prefix cache when
jobs share one image (issue 27).

One run makes a tiny random-weight LLaVA directory (genq_dev/tiny_vlm.py, as the tests do: a CLIP
tower, an MLP projector, a tiny llama) and runs, on the engine alone (no queue), on a fresh
Generator each time (prefix caching on):

  text       --jobs prompts of --text-tokens token ids + a distinct tail, greedy, --max-new-tokens
             tokens, no stop: all enqueued at once.
  image      the same prompts with an image token after the text (a distinct generated image per
             job, preprocessed and keyed where the worker would, encoded by the engine when it
             admits the jobs).
  shared     one job alone, then --jobs jobs at once: the same text, the SAME image, distinct tails.
  distinct   as shared, each job with its own image.

Per run: wall time from the first prepare (the images' preprocessing) to the last result, jobs/s,
the vision tower's forwards and the images they encoded, and, for shared and distinct, the prefix
hit rate of the --jobs jobs after the first (prompt tokens read from the cache over all their prompt
tokens). Timings are the best of --repeats runs, the modes interleaved, after one warm-up run.

    python bench/multimodal.py            # 32 jobs, 3 repeats (about a minute on 2 cores)
    python bench/multimodal.py --quick    # 8 jobs, 2 repeats (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import (
    bench_parser,
    machine_info,
    progress,
    save_figure,
    subplots,
    table_lines,
    warn_if_busy,
    write_results,
)
from PIL import Image

from engine import Generator, Job
from engine.vision.images import ImageEncoder, expand_image_placeholders
from genq_dev.tiny_vlm import make_tiny_vlm

TIMING_METHOD = "wall: time.perf_counter() from the first image prepared to the last job's final result; best of runs"
PAGE_SIZE = 16
MODES = ("text", "image", "shared", "distinct")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, "8 jobs, 2 repeats", "Writes bench/results/multimodal[_quick].{json,png}.")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text-tokens", type=int, default=2 * PAGE_SIZE, help="shared text before the image")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.repeats = 8, 2
    return args


def images(count: int, seed: int) -> list[Image.Image]:
    """Noise images of an odd size, so the processor resizes and crops each."""
    rng = np.random.default_rng(seed + 1)
    return [Image.fromarray(rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)) for _ in range(count)]


def prompts(args: argparse.Namespace, vision: ImageEncoder, with_image: bool) -> list[list[int]]:
    """The shared text, the image token (with_image), then a tail of 4 ids distinct per job."""
    text = [10 + i % 50 for i in range(args.text_tokens)]
    image = [vision.image_token_id] if with_image else []
    return [text + image + [70 + (job * 4 + k) % 40 for k in range(4)] for job in range(args.jobs)]


def run_jobs(generator: Generator, vision: ImageEncoder, ids: list[list[int]], pictures: list[Image.Image | None],
             max_new_tokens: int) -> None:
    """Prepare each job's image, enqueue them all, iterate until every job has ended."""
    jobs = []
    for prompt, picture in zip(ids, pictures, strict=True):
        embeddings = vision.prepare([picture]) if picture is not None else []
        jobs.append(Job(expand_image_placeholders(prompt, embeddings, vision.image_token_id) if embeddings
                        else prompt, max_new_tokens, stop_conditions=[], embeddings=embeddings))
    generator.enqueue(jobs)
    while generator.num_remaining_jobs():
        generator.iterate()


def run_mode(mode: str, model: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    generator = Generator.from_pretrained(model, cache_tokens=args.jobs * 4 * (args.text_tokens + 40),
                                          page_size=PAGE_SIZE, max_batch_size=args.jobs)
    vision = generator.vision
    assert vision is not None, "the tiny LLaVA directory loads its tower"
    with_image = mode != "text"
    ids = prompts(args, vision, with_image)
    pictures: list[Image.Image | None]
    if mode == "shared":
        pictures = images(1, seed) * (args.jobs + 1)
    elif mode == "distinct":
        pictures = list(images(args.jobs + 1, seed))
    elif mode == "image":
        pictures = list(images(args.jobs, seed))
    else:
        pictures = [None] * args.jobs
    start = time.perf_counter()
    if mode in ("shared", "distinct"):
        run_jobs(generator, vision, ids[:1], pictures[:1], args.max_new_tokens)
        first = generator.stats
        cached0, computed0 = first.cached_prompt_tokens, first.computed_prompt_tokens
        start = time.perf_counter()
        run_jobs(generator, vision, ids, pictures[1:], args.max_new_tokens)
    else:
        cached0 = computed0 = 0
        run_jobs(generator, vision, ids, pictures, args.max_new_tokens)
    wall = time.perf_counter() - start
    stats = generator.stats
    cached, computed = stats.cached_prompt_tokens - cached0, stats.computed_prompt_tokens - computed0
    return {"wall_s": wall, "jobs_per_s": args.jobs / wall, "tower_forwards": vision.tower_batches,
            "images_encoded": vision.images_encoded, "prompt_tokens_cached": cached,
            "prompt_tokens_computed": computed, "prefix_hit_rate": round(cached / (cached + computed), 4)}


def plot(results: dict[str, Any], path: Path) -> None:
    modes = results["modes"]
    fig, axes = subplots(1, 2, (10, 4))
    axes[0].bar(["text", "image"], [modes["text"]["jobs_per_s"], modes["image"]["jobs_per_s"]],
                color=["#999", "#27a"])
    axes[0].set_title("jobs/s, one image each vs text only (higher is better)")
    axes[1].bar(["shared image", "distinct images"], [modes["shared"]["prefix_hit_rate"],
                                                      modes["distinct"]["prefix_hit_rate"]], color=["#2a7", "#999"])
    axes[1].set_ylim(0, 1)
    axes[1].set_title("prefix cache hit rate after the first job")
    s = results["settings"]
    fig.suptitle(f"tiny random LLaVA, {s['jobs']} jobs, {s['tokens_per_image']} tokens/image, "
                 f"{s['max_new_tokens']} new tokens - {results['machine']['date']}", fontsize=9)
    save_figure(fig, path, dpi=100)


def markdown_table(results: dict[str, Any]) -> str:
    return "\n".join(table_lines(
        ["run", "jobs/s", "wall", "tower forwards", "images encoded", "prefix hit rate"], "llllll",
        [[mode, f"{f['jobs_per_s']:.1f}", f"{f['wall_s']:.2f} s", f["tower_forwards"], f["images_encoded"],
          f"{f['prefix_hit_rate']:.1%}"] for mode, f in results["modes"].items()]))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warn_if_busy(1)
    results: dict[str, Any] = {"machine": machine_info(), "timing": TIMING_METHOD, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="genq-bench-") as tmp:
        model = make_tiny_vlm(Path(tmp) / "llava", "llava")
        run_mode("image", model, args, seed=-1)  # warm-up: the process's first forwards pay one-time costs
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for seed in range(args.repeats):  # modes interleaved, so a busy spell slows all of them alike
            for mode in MODES:
                runs[mode].append(run_mode(mode, model, args, seed))
        for mode in MODES:
            best = min(runs[mode], key=lambda run: run["wall_s"])
            results["modes"][mode] = {**best, "wall_s": round(best["wall_s"], 3),
                                      "jobs_per_s": round(best["jobs_per_s"], 2)}
            progress(f"{mode}: {results['modes'][mode]}")
        results["settings"] = {"jobs": args.jobs, "repeats": args.repeats, "text_tokens": args.text_tokens,
                               "max_new_tokens": args.max_new_tokens, "page_size": PAGE_SIZE,
                               "tokens_per_image": json.loads((model / "config.json").read_text())["image_seq_length"],
                               "model": "genq_dev/tiny_vlm.py llava (random weights)"}
    write_results(results, args.out, "multimodal", args.quick, plot, markdown_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
