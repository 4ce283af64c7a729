"""Weight-only quantized linear layers on CPU: which kernel each dtype should
use (engine/quantized_linear.py's table), and what quantization does to a
SmolLM2-135M decode step.

    python bench/quantized_linear.py [--threads N]  # writes bench/results/quantized_linear.{json,png}
    python bench/quantized_linear.py --smoke        # one tiny case of each, times nothing worth reading

Part 1, per dtype (fp32, bf16, fp16) and batch (1, 32, 256 rows), the sum
over SmolLM2-135M's four projections (576 -> 960 qkv, 576 -> 576 o,
576 -> 3072 gate/up, 1536 -> 576 down) of the best time of several runs:

- full: F.linear on the full-precision weight (the baseline);
- int8 dequant: int8 -> scaled float weight, then F.linear (the reference);
- int8 scale-after: F.linear on the int8 weight cast to x's dtype, times the
  per-channel scales (exact algebra: a row's scale factors out);
- int8 aten: torch.ops.aten._weight_int8pack_mm;
- int4 dequant: unpack, scale, offset, F.linear (the reference, group 32);
- int4 aten: torch.ops.aten._weight_int4pack_mm_for_cpu on its own layout.

Part 2: one SmolLM2 decode step (batch 1 and 16, 64 tokens of context) in
fp32 with the real Q4_1 weights: dequantized (quantize=None) vs int8 vs int4,
and the bytes of the linear layers' weights.

The machine is shared by other jobs while this runs (see the load average in
the JSON); "best of N" is the figure least disturbed by that, and one thread
(--threads 1, the default) is, unlike a team of threads, not stalled at
every op by a busy neighbour.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import RESULTS_DIR, load_average, machine_info, progress, results_json

from engine.batch import ForwardBatch
from engine.quantized_linear import QuantizedLinear, quantize_weight
from kernels.quant_matmul import quant_matmul_reference, unpack_int4

SMOKE = "--smoke" in sys.argv
SHAPES = [(64, 96), (64, 64)] if SMOKE else [(576, 960), (576, 576), (576, 3072), (1536, 576)]
BATCHES = [1, 4] if SMOKE else [1, 32, 256]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPEATS = 1 if SMOKE else 5
THREADS = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1


def best_us(fn: Callable[[], object], calls: int) -> float:
    """Best mean time of `calls` calls over REPEATS runs, in microseconds."""
    fn()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def candidates(k: int, n: int, m: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(k * n)
    weight = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g).to(dtype)
    full = weight.to(dtype)
    w8 = quantize_weight(weight, "int8")
    w4 = quantize_weight(weight, "int4")
    scales8 = w8.scales.squeeze(1).to(dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(w4.qweight).to(torch.int32), 2)
    zeros = torch.stack([w4.scales, w4.offsets + 8 * w4.scales], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return {
        "full": lambda: F.linear(x, full),
        "int8 dequant": lambda: quant_matmul_reference(x, w8.qweight, w8.scales, None, 8, k),
        "int8 scale-after": lambda: F.linear(x, w8.qweight.to(dtype)) * scales8,
        "int8 aten": lambda: torch.ops.aten._weight_int8pack_mm(x, w8.qweight, scales8),
        "int4 dequant": lambda: quant_matmul_reference(x, w4.qweight, w4.scales, w4.offsets, 4, 32),
        "int4 aten": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, zeros),
    }


def kernel_table() -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for dtype_name, dtype in DTYPES.items():
        for m in BATCHES:
            totals: dict[str, float] = {}
            for k, n in SHAPES:
                calls = 1 if m >= 256 else 3
                for name, fn in candidates(k, n, m, dtype).items():
                    totals[name] = totals.get(name, 0.0) + best_us(fn, calls)
            table.setdefault(dtype_name, {})[str(m)] = {name: round(t) for name, t in totals.items()}
            progress(f"{dtype_name} batch {m}: {table[dtype_name][str(m)]}")
    return table


def decode_steps() -> dict[str, dict[str, float]]:
    """ms per SmolLM2 decode step (fp32) and linear-weight bytes, per quantize setting."""
    from engine.cache import KVCache
    from engine.weights import load_model
    from genq_dev.demo_model import fetch_smollm2

    path = fetch_smollm2()
    out: dict[str, dict[str, float]] = {}
    for quantize in (None, "int8", "int4"):
        model = load_model(path, quantize=quantize)
        row: dict[str, float] = {"linear_weight_mib": round(_linear_bytes(model) / 2**20, 1)}
        for batch in (1, 16):
            cache = KVCache.allocate(model.config, batch * CONTEXT // PAGE + 1, PAGE, torch.float32, "cpu")
            model.bind_cache(cache)
            with torch.inference_mode():
                model(_batch(batch, 0, CONTEXT - 1))
                step = _batch(batch, CONTEXT - 1, CONTEXT)
                row[f"decode_step_ms_batch{batch}"] = round(best_us(partial(model, step), 3) / 1000, 1)
        out[str(quantize)] = row
        progress(f"decode quantize={quantize}: {row}")
    return out


CONTEXT, PAGE = 64, 16


def _batch(batch: int, start: int, end: int) -> ForwardBatch:
    """Positions [start, end) of `batch` sequences, sequence b on pages b * 4 .. b * 4 + 3."""
    pages = CONTEXT // PAGE
    tokens = end - start
    positions = torch.arange(start, end).repeat(batch)
    seq = torch.arange(batch).repeat_interleave(tokens)
    return ForwardBatch(
        input_ids=(positions * 7 + seq) % 1000,
        positions=positions,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32) * tokens,
        context_lens=torch.full((batch,), end, dtype=torch.int32),
        page_table=(torch.arange(batch)[:, None] * pages + torch.arange(pages)).to(torch.int32),
        slot_mapping=seq * CONTEXT + positions,
        logits_indices=torch.arange(1, batch + 1) * tokens - 1,
    )


def _linear_bytes(model: torch.nn.Module) -> int:
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_bytes()
        elif name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            total += module.weight.numel() * module.weight.element_size()
    return total


def plot(table: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 4), sharey=False)
    for ax, (dtype_name, rows) in zip(axes, table.items(), strict=True):
        names = list(next(iter(rows.values())))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar([j + i * width for j in range(len(rows))], [rows[m][name] / 1000 for m in rows], width,
                   label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"batch {m}" for m in rows])
        ax.set_yscale("log")
        ax.set_ylabel("ms per layer (4 projections)")
        ax.set_title(dtype_name)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M projections on CPU: full vs weight-only int8 / int4 kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    torch.set_num_threads(THREADS)
    result: dict[str, Any] = {"machine": machine_info(), "kernels_us_per_layer": kernel_table()}
    if not SMOKE:
        result["smollm2_fp32"] = decode_steps()
    result["load_average_at_end"] = load_average()
    if SMOKE:
        return
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "quantized_linear.json").write_text(results_json(result))
    plot(result["kernels_us_per_layer"], RESULTS_DIR / "quantized_linear.png")
    progress(f"wrote {RESULTS_DIR / 'quantized_linear.json'}")


if __name__ == "__main__":
    main()
