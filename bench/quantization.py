"""Quantized KV cache and quantized weights on the real model: what they cost in quality and
speed, and what they buy in memory (issue 13).

    python bench/quantization.py            # writes bench/results/quantization.{json,png}
    python bench/quantization.py --quick    # 512 tokens of prose, 8 prompts: quantization_quick.*

SmolLM2-135M-Instruct (the Q4_1 GGUF, run in fp32 on the CPU), in one run:

- KV cache formats (auto = the model's dtype, fp8, q8, q4, k8v4): bytes per token (also for a
  16-bit model, what a GPU would hold), how many 768-token jobs a 1 GiB cache holds,
  perplexity of bench/data/prose.txt (public-domain English prose) through the engine's paged
  cache and its change against the full-precision cache, teacher-forced top-1 agreement over
  the same text, greedy agreement of 32 chat answers (tokens before the first difference), and
  decode tokens/s of those 32 jobs;
- weights (dequantized to fp32, int8, int4): bytes of the linear layers, the same perplexity
  and agreement, and greedy decode tokens/s at batch 1 and 32.

All points are measured in this one run on the same machine; the load average is recorded.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
from bench_common import RESULTS_DIR, machine_info, progress, table_lines, write_results

import kernels
from engine import Generator, Job
from engine.cache import KVCache
from engine.model import CausalLM
from engine.tokenizer import Tokenizer
from engine.weights import load_model
from genq_dev.demo_model import fetch_smollm2
from genq_dev.perplexity import TextScores, score_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PROSE = Path(__file__).resolve().parent / "data" / "prose.txt"
CACHE_BUDGET = 1 << 30
JOB_TOKENS = 768
WEIGHT_FORMATS = (None, "int8", "int4")
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "Write one sentence about the sea.",
    "How many legs does a spider have?", "What is photosynthesis?", "Give me a synonym for happy.",
    "Why is the sky blue?", "What is 12 times 7?", "Describe a cat in one sentence.",
    "What does a thermometer measure?", "Name a planet with rings.", "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?", "What is the largest ocean?", "Translate 'thank you' into French.",
    "What is a prime number?", "Suggest a name for a pet goldfish.", "What do bees make?",
    "How many days are in a leap year?", "What is the opposite of cold?", "Name a fruit that is yellow.",
    "What language is spoken in Brazil?", "What is the freezing point of water in Fahrenheit?",
    "Give one tip for sleeping well.", "What is the chemical symbol for gold?", "Name a musical instrument.",
    "What is the tallest animal?", "How many continents are there?", "What is a haiku?",
    "Why do leaves change colour in autumn?", "What is gravity?", "Name something you can recycle.",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512 prose tokens and 8 prompts; *_quick files")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per chat answer (default 32)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def greedy(generator: Generator, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt's greedy answer, all batched, and the generated tokens per second."""
    generator.enqueue([Job(p, tokens, stop_conditions=[], identifier=i) for i, p in enumerate(prompts)])
    out: dict[int, list[int]] = {}
    started = time.perf_counter()
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                out[result.identifier] = list(result.completion_ids)
    elapsed = time.perf_counter() - started
    return [out[i] for i in range(len(prompts))], len(prompts) * tokens / elapsed


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Share of the reference's tokens produced before each answer first differs from it."""
    same = 0
    for a, b in zip(reference, other, strict=True):
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / sum(len(a) for a in reference)


def prose_scores(model: CausalLM, ids: list[int], cache_dtype: str) -> TextScores:
    cache = KVCache.allocate(model.config, -(-len(ids) // 16), 16, torch.float32, "cpu", cache_dtype)
    return score_text(model, cache, ids, chunk_size=64)


def linear_bytes(model: CausalLM) -> int:
    """Bytes of the attention and MLP projections' weights (buffers included: quantized weights live there)."""
    total = 0
    for name, module in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def cache_rows(path: Path, model: CausalLM, ids: list[int], prompts: list[list[int]], tokens: int
               ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    reference: TextScores | None = None
    answers: list[list[int]] = []
    for cache_dtype in kernels.KV_CACHE_DTYPES:
        progress(f"cache {cache_dtype}: perplexity over {len(ids)} tokens")
        scores = prose_scores(model, ids, cache_dtype)
        progress(f"cache {cache_dtype}: {len(prompts)} greedy chat answers")
        generator = Generator.from_pretrained(path, cache_tokens=len(prompts) * 256, cache_dtype=cache_dtype)
        outputs, speed = greedy(generator, prompts, tokens)
        reference = reference or scores
        answers = answers or outputs
        per_token = KVCache.bytes_per_token(model.config, torch.float32, cache_dtype)
        per_token_16 = KVCache.bytes_per_token(model.config, torch.bfloat16, cache_dtype)
        rows.append({
            "cache_dtype": cache_dtype,
            "bytes_per_token_fp32_model": per_token,
            "bytes_per_token_16bit_model": per_token_16,
            "jobs_in_1gib_16bit": CACHE_BUDGET // (JOB_TOKENS * per_token_16),
            "perplexity": scores.perplexity,
            "perplexity_change_pct": 100 * (scores.perplexity / reference.perplexity - 1),
            "top1_agreement": scores.agreement(reference),
            "greedy_agreement": agreement(answers, outputs),
            "decode_tokens_per_s": speed,
        })
        progress(f"cache {cache_dtype}: {rows[-1]}")
    return rows


def weight_rows(path: Path, ids: list[int], prompts: list[list[int]], tokens: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    reference: TextScores | None = None
    answers: list[list[int]] = []
    for quantize in WEIGHT_FORMATS:
        name = quantize or "fp32 (dequantized)"
        progress(f"weights {name}: perplexity over {len(ids)} tokens")
        model = load_model(path, quantize=quantize)
        scores = prose_scores(model, ids, "auto")
        generator = Generator.from_pretrained(path, cache_tokens=len(prompts) * 256, quantize=quantize)
        progress(f"weights {name}: batch 1 and batch {len(prompts)} decode")
        _, speed_1 = greedy(generator, prompts[:1], tokens)
        outputs, speed_n = greedy(generator, prompts, tokens)
        reference = reference or scores
        answers = answers or outputs
        rows.append({
            "weights": name,
            "linear_weight_bytes": linear_bytes(model),
            "perplexity": scores.perplexity,
            "perplexity_change_pct": 100 * (scores.perplexity / reference.perplexity - 1),
            "top1_agreement": scores.agreement(reference),
            "greedy_agreement": agreement(answers, outputs),
            "decode_tokens_per_s_batch_1": speed_1,
            f"decode_tokens_per_s_batch_{len(prompts)}": speed_n,
        })
        progress(f"weights {name}: {rows[-1]}")
    return rows


def plot(results: dict[str, Any], png: Path) -> None:
    caches, weights = results["cache"], results["weights"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in caches:
        left.scatter(row["bytes_per_token_16bit_model"] / 1024, row["perplexity_change_pct"], s=60)
        left.annotate(row["cache_dtype"], (row["bytes_per_token_16bit_model"] / 1024, row["perplexity_change_pct"]),
                      textcoords="offset points", xytext=(6, 4))
    left.axhline(1, color="grey", linestyle=":", label="fp8/q8 target (1%)")
    left.axhline(5, color="grey", linestyle="--", label="4-bit target (5%)")
    left.set_xlabel("KV bytes per token, 16-bit model (KiB)")
    left.set_ylabel("perplexity change vs full-precision cache (%)")
    left.set_title("KV cache formats: memory vs quality")
    left.legend()
    batch = results["prompts"]
    batch_key = f"decode_tokens_per_s_batch_{batch}"
    labels = [row["weights"] for row in weights]
    x = range(len(weights))
    right.bar([i - 0.2 for i in x], [row["decode_tokens_per_s_batch_1"] for row in weights], 0.4, label="batch 1")
    right.bar([i + 0.2 for i in x], [row[batch_key] for row in weights], 0.4, label=f"batch {batch}")
    right.set_xticks(list(x), labels)
    right.set_ylabel("greedy decode tokens/s (CPU, fp32 activations)")
    right.set_title("Weight formats: decode speed")
    right.legend()
    figure.suptitle(f"SmolLM2-135M-Instruct, {results['prose_tokens']} tokens of prose, "
                    f"{results['prompts']} chat prompts")
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def table(results: dict[str, Any]) -> str:
    batch = results["prompts"]
    cache = table_lines(
        ["KV cache", "bytes/token (fp32 model)", "bytes/token (16-bit model)", "768-token jobs in 1 GiB (16-bit)",
         "perplexity", "change", "top-1 agreement", "greedy agreement", f"decode tok/s (batch {batch})"], "l" * 9,
        [[row["cache_dtype"], f"{row['bytes_per_token_fp32_model']:,}", f"{row['bytes_per_token_16bit_model']:,}",
          f"{row['jobs_in_1gib_16bit']:,}", f"{row['perplexity']:.3f}", f"{row['perplexity_change_pct']:+.2f}%",
          f"{row['top1_agreement']:.1%}", f"{row['greedy_agreement']:.1%}", f"{row['decode_tokens_per_s']:.1f}"]
         for row in results["cache"]])
    weights = table_lines(
        ["weights", "linear weights (MiB)", "perplexity", "change", "top-1 agreement", "greedy agreement",
         "decode tok/s batch 1", f"decode tok/s batch {batch}"], "l" * 8,
        [[row["weights"], f"{row['linear_weight_bytes'] / 2**20:.1f}", f"{row['perplexity']:.3f}",
          f"{row['perplexity_change_pct']:+.2f}%", f"{row['top1_agreement']:.1%}", f"{row['greedy_agreement']:.1%}",
          f"{row['decode_tokens_per_s_batch_1']:.1f}", f"{row[f'decode_tokens_per_s_batch_{batch}']:.1f}"]
         for row in results["weights"]])
    return "\n".join([*cache, "", *weights])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    path = fetch_smollm2()
    tokenizer = Tokenizer.from_pretrained(path)
    ids = tokenizer.encode(PROSE.read_text())
    questions = QUESTIONS[:8] if args.quick else QUESTIONS
    if args.quick:
        ids = ids[:512]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    results: dict[str, Any] = {"machine": machine_info(), "model": path.name, "prose_tokens": len(ids),
                               "prompts": len(prompts), "new_tokens": args.new_tokens,
                               "cache_budget_bytes": CACHE_BUDGET, "job_tokens": JOB_TOKENS}
    started = time.perf_counter()
    results["cache"] = cache_rows(path, load_model(path), ids, prompts, args.new_tokens)
    results["weights"] = weight_rows(path, ids, prompts, args.new_tokens)
    results["seconds"] = math.ceil(time.perf_counter() - started)
    write_results(results, args.out, "quantization", args.quick, plot, table)


if __name__ == "__main__":
    main()
