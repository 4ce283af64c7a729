"""The engine now against the engine of an earlier commit, on a real model:
SmolLM2-135M-Instruct, 32 chat requests (issue 10's throughput check).

The earlier engine (default: e10f379, the commit the host-overhead issue was
measured at) cannot read GGUF files, so both run on the same HF directory,
written once from the GGUF by transformers' own GGUF loader
(`save_pretrained`, fp32; cached under the models directory). Each engine
runs in its own subprocess with its own tree first on PYTHONPATH (the old one
from `git archive REV`), the same torch thread count, all requests enqueued
at once and `iterate()` until done, greedy, after a warm-up. The requests are
32 questions rendered with the model's chat template, 128 new tokens each
(EOS never stops a request, so both generate the same number of tokens).
Generated tokens are compared request by request.

Writes bench/results/engine_versions.{json,png} and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
from bench_common import RESULTS_DIR, bench_main, progress, save_figure, start_run, table_lines

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "e10f379"
TOPICS = [
    "cooking at home", "learning a language", "riding a bicycle", "reading novels", "keeping a garden",
    "walking every day", "writing letters", "playing chess", "visiting museums", "learning to swim",
    "baking bread", "watching birds", "playing the piano", "camping outdoors", "volunteering",
    "learning history", "drinking water", "sleeping well", "saving money", "fixing a bicycle",
    "painting landscapes", "growing tomatoes", "studying maths", "running a marathon", "keeping a diary",
    "learning to code", "hiking in mountains", "making friends", "cleaning the house", "travelling by train",
    "reading the news", "taking photographs",
]

# Runs inside each engine's subprocess: argv = model dir, requests JSON, threads, output JSON.
RUNNER = r"""
import json, sys, time
import torch
from engine import Generator, Job
model, requests_path, threads, out_path = sys.argv[1:5]
torch.set_num_threads(int(threads))
prompts = json.loads(open(requests_path).read())
gen = Generator.from_pretrained(model, cache_tokens=len(prompts) * 512, page_size=16,
                                max_batch_size=len(prompts), max_chunk_size=2048)
def run(prompts, max_new):
    for i, prompt in enumerate(prompts):
        gen.enqueue(Job(prompt, max_new, stop_conditions=[], identifier=i))
    tokens = {}
    start = time.perf_counter()
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["eos"]:
                tokens[r["identifier"]] = list(r["completion_ids"])
    return time.perf_counter() - start, [tokens[i] for i in range(len(prompts))]
run(prompts[:2], 4)
wall, tokens = run(prompts, MAX_NEW)
json.dump({"wall_s": wall, "tokens": tokens}, open(out_path, "w"))
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the model (default: SmolLM2-135M-Instruct, fetched once like `genq dev` does)")
    parser.add_argument("--baseline", default=BASELINE, help=f"the earlier engine's commit (default {BASELINE})")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both engines (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def hf_directory(gguf: Path) -> Path:
    """The GGUF as an HF directory (fp32 safetensors + tokenizer), written once by transformers."""
    target = gguf.parent / f"{gguf.stem}-hf"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"writing {target} from {gguf.name} with transformers' GGUF loader (once)")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; its dequantized weights go into a plain copy.
    config = loaded.config
    config.quantization_config = None
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(target)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(target)
    return target


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [f"What are three good reasons to take up {TOPICS[i % len(TOPICS)]}?" for i in range(count)]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for q in questions]


def run_engine(tree: Path, model_dir: Path, requests: Path, threads: int, max_new: int, work: Path,
               label: str) -> dict[str, Any]:
    out = work / f"{label}.json"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = RUNNER.replace("MAX_NEW", str(max_new))
    progress(f"{label}: running {tree}")
    subprocess.run([sys.executable, "-c", code, str(model_dir), str(requests), str(threads), str(out)],
                   cwd=work, env=env, check=True)
    result = json.loads(out.read_text())
    generated = sum(len(t) for t in result["tokens"])
    result["generated_tokens_per_s"] = round(generated / result["wall_s"], 2)
    progress(f"{label}: {result['generated_tokens_per_s']} generated tok/s ({result['wall_s']:.1f} s)")
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = start_run(args.threads)
    if args.gguf is None:
        from genq_dev.demo_model import fetch_smollm2

        args.gguf = fetch_smollm2()
    model_dir = hf_directory(args.gguf)
    prompts = chat_prompts(model_dir, args.requests)
    with tempfile.TemporaryDirectory(prefix="genq-versions-") as tmp:
        work = Path(tmp)
        requests = work / "requests.json"
        requests.write_text(json.dumps(prompts))
        old_tree = work / "baseline"
        old_tree.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline, "engine", "kernels"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        engines = {
            f"baseline ({args.baseline})": run_engine(old_tree, model_dir, requests, args.threads,
                                                      args.max_new_tokens, work, "baseline"),
            "current": run_engine(ROOT, model_dir, requests, args.threads, args.max_new_tokens, work, "current"),
        }
    baseline, current = engines.values()
    same = sum(a == b for a, b in zip(baseline["tokens"], current["tokens"], strict=True))
    return {
        "method": __doc__,
        "machine": machine,
        "model": args.gguf.name,
        "requests": args.requests,
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "engines": {label: {k: v for k, v in e.items() if k != "tokens"} for label, e in engines.items()},
        "speedup": round(current["generated_tokens_per_s"] / baseline["generated_tokens_per_s"], 3),
        "identical_requests": same,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = list(results["engines"])
    ax.bar(labels, [results["engines"][label]["generated_tokens_per_s"] for label in labels])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{results['model']}, {results['requests']} chat requests: {results['speedup']}x")
    save_figure(fig, path)


def table(results: dict[str, Any]) -> str:
    lines = table_lines(["engine", "generated tok/s", "wall (s)"], "lrr", [
        [label, f"{engine['generated_tokens_per_s']:.1f}", f"{engine['wall_s']:.1f}"]
        for label, engine in results["engines"].items()])
    lines.append(f"\nspeedup {results['speedup']}x; identical outputs {results['identical_requests']}"
                 f"/{results['requests']}")
    return "\n".join(lines)


main = bench_main("engine_versions", parse_args, run, plot, table)


if __name__ == "__main__":
    main()
