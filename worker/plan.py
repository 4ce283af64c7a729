"""`genq plan`: how a model's weights, a step's reserve and the KV cache share a GPU, without
loading weights (engine/memory_plan.py does the arithmetic; this reads the model and prints)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.engine_config import DEFAULT_PAGE_SIZE, GPU_MEMORY_UTILIZATION
from engine.errors import ModelLoadError
from engine.memory_plan import (
    DTYPE_BYTES,
    KV_FORMATS,
    QUANTIZE_FORMATS,
    CachePlan,
    PlanError,
    parameter_count,
    plan_cache,
    step_reserve,
    weight_bytes,
)
from engine.named_configs import NAMED_CONFIGS

GPUS = {"h100-80gb": 81559 << 20, "h200-141gb": 143771 << 20, "a100-80gb": 81920 << 20,
        "a100-40gb": 40960 << 20, "l40s-48gb": 46068 << 20, "rtx4090-24gb": 24564 << 20}
"""Named GPUs: the total memory nvidia-smi reports for each."""
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)
_GIB = 2**30


class UsageError(ValueError):
    """Bad input: the message names the option and the limit."""


@dataclass(frozen=True)
class ModelSource:
    """A model's config, and for a .gguf file the bytes of its tensors by ggml type."""

    name: str
    config: ModelConfig
    gguf_tensor_bytes: dict[str, int] | None = None


def parse_size(text: str) -> int:
    """'80GB' (10^9), '80GiB' (2^30), '512MiB', ... -> bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise UsageError(f"--gpu-memory {text!r} is not a size: a number and a unit of {', '.join(_UNITS)} "
                         "(GB = 10^9 bytes, GiB = 2^30), e.g. 80GB")
    return int(float(match.group(1)) * _UNITS[unit])


def read_model(model: str) -> ModelSource:
    """A named config, an HF directory's config.json, or a .gguf file's header (tensor data is not read)."""
    if model in NAMED_CONFIGS:
        return ModelSource(model, ModelConfig.from_dict(NAMED_CONFIGS[model]))
    path = Path(model)
    if (path / "config.json").is_file():
        return ModelSource(str(path), ModelConfig.from_dir(path))
    if path.is_file():
        from engine.gguf_file import is_gguf, open_gguf

        if is_gguf(path):
            gguf = open_gguf(path)
            sizes: dict[str, int] = {}
            for tensor in gguf.reader.tensors:
                sizes[tensor.tensor_type.name] = sizes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
            return ModelSource(str(path), ModelConfig.from_dict(gguf.config_dict()), sizes)
    raise UsageError(f"model {model!r} is not a named config ({', '.join(NAMED_CONFIGS)}), a Hugging Face model "
                     "directory (config.json) or a .gguf file")


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything `genq plan` prints, as a JSON-ready dict; UsageError / PlanError for bad input."""
    if args.gpu is not None:
        gpu_bytes = GPUS[args.gpu]
    elif args.gpu_memory is not None:
        gpu_bytes = parse_size(args.gpu_memory)
    else:
        raise UsageError(f"give --gpu-memory SIZE (e.g. 80GB) or --gpu NAME ({', '.join(GPUS)})")
    for option, value in (("--job-tokens", args.job_tokens), ("--page-size", args.page_size),
                          ("--max-batch-size", args.max_batch_size), ("--max-chunk-size", args.max_chunk_size)):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be at least 1, got {value}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    source = read_model(args.model)
    config = source.config
    gguf = source.gguf_tensor_bytes is not None
    checkpoint_dtype = "float32" if gguf or config.torch_dtype not in DTYPE_BYTES else config.torch_dtype
    dtype = args.dtype or checkpoint_dtype
    dtype_bytes = DTYPE_BYTES[dtype]
    weights = {fmt: weight_bytes(config, DTYPE_BYTES[fmt]) for fmt in DTYPE_BYTES}
    weights |= {f"{q} (rest {dtype})": weight_bytes(config, dtype_bytes, q, gguf) for q in QUANTIZE_FORMATS}
    planned_weights = weight_bytes(config, dtype_bytes, args.quantize, gguf)
    reserve = step_reserve(config, dtype_bytes, args.max_chunk_size, args.max_batch_size)

    def plan(cache_dtype: str) -> CachePlan:
        return plan_cache(config, gpu_bytes, planned_weights, cache_dtype, dtype_bytes, args.page_size,
                          args.job_tokens, args.gpu_memory_utilization, args.max_chunk_size, args.max_batch_size)

    try:
        chosen = plan(args.cache_dtype)
    except PlanError as error:
        raise UsageError(f"--gpu-memory {gpu_bytes / _GIB:.2f} GiB is too small: {error}") from error
    caches = []
    for cache_dtype in KV_FORMATS:
        try:
            caches.append(_cache_row(plan(cache_dtype)))
        except PlanError as error:
            caches.append({"cache_dtype": cache_dtype, "error": str(error)})
    return {
        "model": source.name, "family": config.family, "parameters": parameter_count(config),
        "layers": config.num_layers, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "sliding_window_layers": sum(config.layer_window(i) is not None for i in range(config.num_layers)),
        "experts": config.num_experts, "gpu_bytes": gpu_bytes, "gpu_memory_utilization": args.gpu_memory_utilization,
        "dtype": dtype, "quantize": args.quantize, "weights": weights, "gguf_tensor_bytes": source.gguf_tensor_bytes,
        "planned_weight_bytes": planned_weights,
        "reserve": {"max_chunk_size": reserve.max_chunk_size, "max_batch_size": reserve.max_batch_size,
                    "activation_bytes": reserve.activation_bytes, "logits_bytes": reserve.logits_bytes,
                    "total_bytes": reserve.total_bytes},
        "page_size": args.page_size, "job_tokens": args.job_tokens, "caches": caches, "plan": _cache_row(chosen),
    }


def _cache_row(plan: CachePlan) -> dict[str, Any]:
    return {"cache_dtype": plan.cache_dtype, "bytes_per_token": plan.kv_bytes_per_token, "page_bytes": plan.page_bytes,
            "num_pages": plan.num_pages, "cache_tokens": plan.cache_tokens, "cache_bytes": plan.cache_bytes,
            "pages_per_job": plan.pages_per_job, "jobs_fit": plan.jobs_fit}


def render(plan: dict[str, Any]) -> str:
    """The plan as a readable table."""
    gib = plan["gpu_bytes"] / _GIB
    lines = [
        f"model        {plan['model']} ({plan['family']}, {plan['parameters'] / 1e9:.2f} B parameters, "
        f"{plan['layers']} layers, {plan['kv_heads']} KV heads x {plan['head_dim']}"
        + (f", {plan['experts']} experts" if plan["experts"] else "") + ")",
        f"GPU memory   {gib:.2f} GiB x utilization {plan['gpu_memory_utilization']:g} = "
        f"{gib * plan['gpu_memory_utilization']:.2f} GiB planned",
        "",
        f"{'weights':<28}{'bytes':>16}{'GiB':>10}",
    ]
    rows = dict(plan["weights"])
    if plan["gguf_tensor_bytes"] is not None:
        types = ", ".join(sorted(plan["gguf_tensor_bytes"]))
        rows[f"the .gguf file ({types})"] = sum(plan["gguf_tensor_bytes"].values())
    lines += [f"  {name:<26}{size:>16,}{size / _GIB:>10.2f}" for name, size in rows.items()]
    planned = plan["dtype"] + (f" + {plan['quantize']} projections" if plan["quantize"] else "")
    lines.append(f"  {'-> loaded as ' + planned:<26}{plan['planned_weight_bytes']:>16,}"
                 f"{plan['planned_weight_bytes'] / _GIB:>10.2f}")
    reserve = plan["reserve"]
    lines += [
        "",
        f"step reserve (max_chunk_size {reserve['max_chunk_size']}, max_batch_size {reserve['max_batch_size']}): "
        f"{reserve['total_bytes'] / 2**20:,.1f} MiB",
        f"  activations  max_chunk_size x dtype bytes x (2 x hidden + max(attention, MLP width))"
        f"{reserve['activation_bytes'] / 2**20:>12,.1f} MiB",
        f"  logits       max_batch_size x vocab x (dtype bytes + 21){reserve['logits_bytes'] / 2**20:>38,.1f} MiB",
        "",
        f"KV cache: every one of the {plan['layers']} layers holds every token"
        + (f" ({plan['sliding_window_layers']} sliding-window layers count in full)"
           if plan["sliding_window_layers"] else ""),
        f"  {'cache_dtype':<12}{'bytes/token':>12}{'page bytes':>12}{'pages':>10}{'tokens':>12}"
        f"{'jobs of ' + str(plan['job_tokens']):>16}",
    ]
    for row in plan["caches"]:
        if "error" in row:
            lines.append(f"  {row['cache_dtype']:<12}  {row['error']}")
            continue
        mark = "  <- planned" if row["cache_dtype"] == plan["plan"]["cache_dtype"] else ""
        lines.append(f"  {row['cache_dtype']:<12}{row['bytes_per_token']:>12,}{row['page_bytes']:>12,}"
                     f"{row['num_pages']:>10,}{row['cache_tokens']:>12,}{row['jobs_fit']:>16,}{mark}")
    chosen = plan["plan"]
    lines += ["", f"jobs that fit: {chosen['jobs_fit']} jobs of {plan['job_tokens']} tokens at once "
                  f"(cache_dtype {chosen['cache_dtype']}: {chosen['num_pages']:,} pages of {plan['page_size']} "
                  f"tokens, {chosen['cache_tokens']:,} tokens, {chosen['cache_bytes'] / _GIB:.2f} GiB)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        plan = build_plan(args)
    except (UsageError, ModelLoadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan", help="how many jobs fit a GPU: weights, step reserve and KV cache, without loading weights",
        description="Plan a model's GPU memory from its config alone (nothing is loaded or downloaded): weight "
                    "bytes per format, the step reserve (activations of a max_chunk_size prefill chunk and "
                    "max_batch_size rows of vocab logits), KV bytes per token and per page for each cache_dtype, "
                    "and how many jobs of --job-tokens fit. A CUDA worker without cache_tokens sizes its cache "
                    "by the same arithmetic (docs/operations.md). Exit 2 on bad input or a GPU too small.",
    )
    plan.add_argument("model", help=f"a named config ({', '.join(NAMED_CONFIGS)}), a Hugging Face model directory "
                                    "(its config.json) or a .gguf file (its header only)")
    memory = plan.add_mutually_exclusive_group()
    memory.add_argument("--gpu-memory", metavar="SIZE", help="the GPU's memory: 80GB (10^9 bytes), 80GiB, 81559MiB")
    memory.add_argument("--gpu", choices=sorted(GPUS), help="a named GPU (its total as nvidia-smi reports it)")
    plan.add_argument("--job-tokens", type=int, default=4096, metavar="N",
                      help="tokens one job holds (prompt + output; default 4096)")
    plan.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                      help="the weights' and activations' dtype (default: the checkpoint's; float32 for .gguf, "
                           "as the worker's GENQ_DTYPE)")
    plan.add_argument("--quantize", choices=QUANTIZE_FORMATS, help="weight-only quantized projections (GENQ_QUANTIZE)")
    plan.add_argument("--cache-dtype", choices=KV_FORMATS, default="auto", help="KV cache storage (GENQ_CACHE_DTYPE)")
    plan.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, metavar="N",
                      help=f"KV page size in tokens (GENQ_PAGE_SIZE, default {DEFAULT_PAGE_SIZE})")
    plan.add_argument("--max-batch-size", type=int, metavar="N", help="GENQ_MAX_BATCH_SIZE (default: the engine's)")
    plan.add_argument("--max-chunk-size", type=int, metavar="N", help="GENQ_MAX_CHUNK_SIZE (default: the engine's)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION, metavar="F",
                      help=f"share of the GPU planned for (GENQ_GPU_MEMORY_UTILIZATION, default "
                           f"{GPU_MEMORY_UTILIZATION})")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=run)
