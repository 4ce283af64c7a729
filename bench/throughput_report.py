"""Turns the engine_throughput results dict into the PNG and the markdown table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from bench_common import measured_when, percentile_bars, percentiles_cell, save_with_legend_below, table_lines  # noqa: E402

SYSTEM_LABELS = {
    "engine": "genq engine",
    "engine-int8": "genq engine (int8)",
    "hf-padded": "transformers padded best",
    "hf-cb": "transformers continuous batching",
    "llama.cpp": "llama.cpp server",
}
_COLORS = {"engine": "tab:blue", "engine-int8": "tab:purple", "hf-padded": "tab:orange", "hf-cb": "tab:green",
           "llama.cpp": "tab:red"}


def headline_runs(model_result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One summary per system: the engine, the best padded configuration, CB (if it ran)."""
    systems = model_result["systems"]
    runs: dict[str, dict[str, Any]] = {}
    for engine in ("engine", "engine-int8"):
        if engine in systems:
            runs[engine] = systems[engine]
    padded = systems.get("hf-padded")
    if padded and padded.get("best"):
        runs["hf-padded"] = padded["runs"][padded["best"]]
    cb = systems.get("hf-cb")
    if cb and "error" not in cb:
        runs["hf-cb"] = cb
    llama = systems.get("llama.cpp")
    if llama and "skipped" not in llama:
        runs["llama.cpp"] = llama
    return runs


def _label(system: str, model_result: dict[str, Any]) -> str:
    if system == "hf-padded":
        return f"{SYSTEM_LABELS[system]} ({model_result['systems']['hf-padded']['best']})"
    return SYSTEM_LABELS[system]


def markdown_table(results: dict[str, Any]) -> str:
    """The table docs/benchmarks.md quotes, one row per (model, system)."""
    rows: list[list[object]] = []
    for model, model_result in results["models"].items():
        runs = headline_runs(model_result)
        for system, run in runs.items():
            ttft = percentiles_cell(run["ttft_ms"], ("p50", "p90", "p99"), 0)
            itl = percentiles_cell(run["itl_ms"], ("p50", "p90", "p99"), 1)
            rows.append([f"{model} ({model_result['parameters'] / 1e6:.1f}M)", _label(system, model_result),
                         f"{run['generated_tok_s']:.1f}", f"{run['total_tok_s']:.1f}", ttft, itl,
                         f"{run['wall_s']:.2f}", f"{run['mfu'] * 100:.2f}%"])
        cb = model_result["systems"].get("hf-cb")
        if cb and "error" in cb:
            rows.append([model, SYSTEM_LABELS["hf-cb"], f"failed: {cb['error'][:80]}", "", "", "", "", ""])
        llama = model_result["systems"].get("llama.cpp")
        if llama and "skipped" in llama:
            rows.append([model, SYSTEM_LABELS["llama.cpp"], f"skipped: {llama['skipped'][:80]}", "", "", "", "", ""])
        if "engine" in runs and "llama.cpp" in runs:
            ratio = runs["engine"]["generated_tok_s"] / runs["llama.cpp"]["generated_tok_s"]
            rows.append([model, "genq / llama.cpp", f"{ratio:.2f}x", "", "", "", "", ""])
    machine = results["machine"]
    lines = table_lines(["model", "system", "generated tok/s", "total tok/s", "TTFT p50 / p90 / p99 (ms)",
                         "ITL p50 / p90 / p99 (ms)", "wall (s)", "MFU"], "llrrrrrr", rows)
    lines.append("")
    lines.append(
        f"{machine['cpu_model']}, {machine['torch_threads']} threads, fp32, torch {machine['torch']}, "
        f"transformers {machine['transformers']}; fp32 matmul peak {results['matmul_peak']['best_gflops']:.1f} "
        f"GFLOP/s; {results['settings']['num_requests']} requests; {measured_when(machine)}."
    )
    return "\n".join(lines)


def _grouped_bars(ax: plt.Axes, results: dict[str, Any], metric: str) -> list[Any]:
    """Bars per model, one per system; for latency metrics the bar is p50 and
    the markers p90 (triangle) and p99 (cross). Returns the bar containers."""
    models = list(results["models"])
    runs = [headline_runs(results["models"][model]) for model in models]
    systems = [s for s in SYSTEM_LABELS if any(s in r for r in runs)]
    return percentile_bars(ax, models, {SYSTEM_LABELS[s]: [r[s][metric] if s in r else None for r in runs]
                                        for s in systems},
                           [_COLORS[s] for s in systems], {"p90": "^", "p99": "x"})


def plot(results: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for container in _grouped_bars(axes[0], results, "generated_tok_s"):
        axes[0].bar_label(container, fmt="%.0f", fontsize=8)
    axes[0].set_title("generated tokens/s (higher is better)")
    _grouped_bars(axes[1], results, "ttft_ms")
    axes[1].set_title("time to first token, ms (bar p50, ^ p90, x p99)")
    _grouped_bars(axes[2], results, "itl_ms")
    axes[2].set_title("inter-token latency, ms (bar p50, ^ p90, x p99)")
    machine = results["machine"]
    save_with_legend_below(fig, axes[0], f"{results['settings']['num_requests']} requests, greedy, fp32 - "
                           f"{machine['cpu_model']}, {machine['torch_threads']} threads - {machine['date']}", path)
