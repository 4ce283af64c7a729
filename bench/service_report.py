"""Turns the service_overhead results dict into the PNG and the markdown table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from bench_common import measured_when, percentile_bars, percentiles_cell, save_with_legend_below, table_lines  # noqa: E402

PATHS = {"engine": "engine alone (in-process)", "service": "service (Celery + Redis + worker)"}
_COLORS = {"engine": "tab:blue", "service": "tab:orange"}


def _pair(values: dict[str, float | None], digits: int, sign: bool = False) -> str:
    """The table's "p50 / p99" cell."""
    return percentiles_cell(values, ("p50", "p99"), digits, sign)


def markdown_table(results: dict[str, Any]) -> str:
    """The table docs/benchmarks.md quotes: per model, both paths and their difference."""
    rows: list[list[object]] = []
    for model, result in results["models"].items():
        label = f"{model} ({result['parameters'] / 1e6:.1f}M)"
        singles = result["single_requests"]
        for path in ("engine", "service"):
            run = result[path]
            equal = ""
            if path == "service":
                check, n = result["correctness"], result["correctness"]["requests"]
                equal = f"{check['texts_equal']}/{n} texts, {check['tokens_equal']}/{n} tokens"
            rows.append([label, PATHS[path], f"{run['generated_tok_s']:.1f}", _pair(run["first_chunk_ms"], 0),
                         _pair(singles[path + "_ms"], 1), equal])
        overhead = result["overhead"]
        rows.append([label, "service - engine", f"x{overhead['throughput_ratio']:.3f}",
                     _pair(overhead["added_first_chunk_ms"], 0, sign=True),
                     f"{_pair(singles['added_ms'], 1, sign=True)} (paired median "
                     f"{singles['paired_added_median_ms']:+.1f})", ""])
    machine = results["machine"]
    settings = results["settings"]
    lines = table_lines(["model", "path", "generated tok/s", "first chunk p50 / p99, all at once (ms)",
                         "first chunk p50 / p99, one at a time (ms)", "outputs equal to the engine's"], "llrrrr", rows)
    lines.append("")
    lines.append(
        f"{machine['cpu_model']}, torch threads: {settings['threads']} (both paths), fp32, torch {machine['torch']}, "
        f"celery {machine['celery']}, redis-server {machine['redis_server']}; {settings['num_requests']} requests "
        f"at once, {settings['single_requests']} single requests of {settings['single_max_new_tokens']} tokens; "
        f"{measured_when(machine)}."
    )
    return "\n".join(lines)


def _bars(ax: plt.Axes, results: dict[str, Any], value: Any) -> list[Any]:
    """One bar per (model, path); value(model_result, path) gives a number or
    a percentile dict (bar p50, cross p99)."""
    models = list(results["models"])
    return percentile_bars(ax, models, {PATHS[p]: [value(results["models"][m], p) for m in models] for p in PATHS},
                           [_COLORS[p] for p in PATHS], {"p99": "x"})


def plot(results: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for container in _bars(axes[0], results, lambda m, p: m[p]["generated_tok_s"]):
        axes[0].bar_label(container, fmt="%.0f", fontsize=8)
    ratios = [f"{name}\nservice/engine x{m['overhead']['throughput_ratio']:.2f}"
              for name, m in results["models"].items()]
    axes[0].set_xticks(range(len(ratios)), ratios)
    axes[0].set_title("generated tokens/s, all requests at once")
    _bars(axes[1], results, lambda m, p: m[p]["first_chunk_ms"])
    axes[1].set_title("first chunk, all at once: ms from submit\n(bar p50, x p99)")
    _bars(axes[2], results, lambda m, p: m["single_requests"][f"{p}_ms"])
    axes[2].set_title("first chunk, one request at a time: ms from submit\n(bar p50, x p99)")
    machine = results["machine"]
    settings = results["settings"]
    save_with_legend_below(fig, axes[0], f"service overhead: {settings['num_requests']} requests, greedy, fp32 - "
                           f"{machine['cpu_model']}, torch threads: {settings['threads']} - {machine['date']}", path)
