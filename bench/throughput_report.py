"""Turns the engine_throughput results dict into the PNG and the markdown table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from bench_common import percentiles_cell, save_figure, side_by_side  # noqa: E402

SYSTEM_LABELS = {
    "engine": "genq engine",
    "hf-padded": "transformers padded best",
    "hf-cb": "transformers continuous batching",
}
_COLORS = {"engine": "tab:blue", "hf-padded": "tab:orange", "hf-cb": "tab:green"}


def headline_runs(model_result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One summary per system: the engine, the best padded configuration, CB (if it ran)."""
    systems = model_result["systems"]
    runs: dict[str, dict[str, Any]] = {}
    if "engine" in systems:
        runs["engine"] = systems["engine"]
    padded = systems.get("hf-padded")
    if padded and padded.get("best"):
        runs["hf-padded"] = padded["runs"][padded["best"]]
    cb = systems.get("hf-cb")
    if cb and "error" not in cb:
        runs["hf-cb"] = cb
    return runs


def _label(system: str, model_result: dict[str, Any]) -> str:
    if system == "hf-padded":
        return f"{SYSTEM_LABELS[system]} ({model_result['systems']['hf-padded']['best']})"
    return SYSTEM_LABELS[system]


def markdown_table(results: dict[str, Any]) -> str:
    """The table docs/benchmarks.md quotes, one row per (model, system)."""
    lines = [
        "| model | system | generated tok/s | total tok/s | TTFT p50 / p90 / p99 (ms) "
        "| ITL p50 / p90 / p99 (ms) | wall (s) | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, model_result in results["models"].items():
        runs = headline_runs(model_result)
        for system, run in runs.items():
            ttft = percentiles_cell(run["ttft_ms"], ("p50", "p90", "p99"), 0)
            itl = percentiles_cell(run["itl_ms"], ("p50", "p90", "p99"), 1)
            lines.append(
                f"| {model} ({model_result['parameters'] / 1e6:.1f}M) | {_label(system, model_result)} "
                f"| {run['generated_tok_s']:.1f} | {run['total_tok_s']:.1f} | {ttft} | {itl} "
                f"| {run['wall_s']:.2f} | {run['mfu'] * 100:.2f}% |"
            )
        cb = model_result["systems"].get("hf-cb")
        if cb and "error" in cb:
            lines.append(f"| {model} | {SYSTEM_LABELS['hf-cb']} | failed: {cb['error'][:80]} | | | | | |")
    machine = results["machine"]
    lines.append("")
    lines.append(
        f"{machine['cpu_model']}, {machine['torch_threads']} threads, fp32, torch {machine['torch']}, "
        f"transformers {machine['transformers']}; fp32 matmul peak {results['matmul_peak']['best_gflops']:.1f} "
        f"GFLOP/s; {results['settings']['num_requests']} requests; load average at start "
        f"{machine['load_average_at_start'][0] if machine['load_average_at_start'] else 'n/a'}; {machine['date']}."
    )
    return "\n".join(lines)


def _grouped_bars(ax: plt.Axes, results: dict[str, Any], metric: str) -> list[Any]:
    """Bars per model, one per system; for latency metrics the bar is p50 and
    the markers p90 (triangle) and p99 (cross). Returns the bar containers."""
    models = list(results["models"])
    systems = [s for s in SYSTEM_LABELS if any(s in headline_runs(m) for m in results["models"].values())]
    containers = []
    for k, system in enumerate(systems):
        positions, width = side_by_side(len(models), len(systems), k)
        xs, p50, p90, p99 = [], [], [], []
        for i, model in enumerate(models):
            run = headline_runs(results["models"][model]).get(system)
            if run is None:
                continue
            xs.append(positions[i])
            if metric == "generated_tok_s":
                p50.append(run[metric])
            else:
                p50.append(run[metric]["p50"] or 0.0)
                p90.append(run[metric]["p90"] or 0.0)
                p99.append(run[metric]["p99"] or 0.0)
        containers.append(ax.bar(xs, p50, width, label=SYSTEM_LABELS[system], color=_COLORS[system]))
        if p90:
            ax.scatter(xs, p90, marker="^", color="black", s=18, zorder=3)
            ax.scatter(xs, p99, marker="x", color="black", s=18, zorder=3)
    ax.set_xticks(range(len(models)), models)
    return containers


def plot(results: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for container in _grouped_bars(axes[0], results, "generated_tok_s"):
        axes[0].bar_label(container, fmt="%.0f", fontsize=8)
    axes[0].set_title("generated tokens/s (higher is better)")
    _grouped_bars(axes[1], results, "ttft_ms")
    axes[1].set_title("time to first token, ms (bar p50, ^ p90, x p99)")
    _grouped_bars(axes[2], results, "itl_ms")
    axes[2].set_title("inter-token latency, ms (bar p50, ^ p90, x p99)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    machine = results["machine"]
    fig.suptitle(
        f"{results['settings']['num_requests']} requests, greedy, fp32 - {machine['cpu_model']}, "
        f"{machine['torch_threads']} threads - {machine['date']}",
        fontsize=10,
    )
    save_figure(fig, path, rect=(0, 0.07, 1, 1))
