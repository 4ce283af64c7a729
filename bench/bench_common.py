"""Helpers shared by the benchmarks: progress lines, machine description,
the machine's fp32 matmul rate, latency percentiles and the cached tiny models;
a measuring run's start (start_run) and end (write_results, which records the
load average at the end; bench_main, the main of a benchmark that runs once);
the figure and table pieces the reports share.

Benchmarks are run as scripts (`python bench/<name>.py`), so this module is
imported as a sibling, not as part of a package.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genq_dev.tiny_model import make_tiny_model, model_config

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
MODEL_CACHE = BENCH_DIR / ".models"
RESULTS_DIR = BENCH_DIR / "results"

_START = time.perf_counter()


def progress(message: str) -> None:
    """One timestamped line on stderr, so a long run is never silent."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def available_cores() -> int:
    """Cores this process may run on (affinity-aware, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on; the load average tells whether the
    machine was shared while they were."""
    import transformers

    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cores_available": available_cores(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_at_start": load_average(),
    }


def load_average() -> list[float] | None:
    """1/5/15-minute load: above the thread count means the timings were shared."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def measured_when(machine: dict[str, Any]) -> str:
    """How a results table's note ends: the load average when the run started (machine_info's) and its date."""
    load = machine["load_average_at_start"]
    return f"load average at start {load[0] if load else 'n/a'}; {machine['date']}"


def warn_if_busy(threads: int) -> None:
    """A busy neighbour stalls every multi-threaded op (an OpenMP team waits for
    its slowest thread), which distorts small-op engines most."""
    load = load_average()
    if load is not None and load[0] + threads > available_cores() + 0.5:
        progress(
            f"warning: load average {load[0]:.2f} with {available_cores()} cores; timings with {threads} threads "
            "will be distorted (run on a quiet machine, or pass --threads 1)"
        )


def start_run(threads: int) -> dict[str, Any]:
    """A measuring run's start: torch on `threads` threads, then the machine's description (with
    a warning when its load would distort the timings)."""
    torch.set_num_threads(threads)
    machine = machine_info()
    warn_if_busy(threads)
    return machine


def matmul_gflops(sizes: Sequence[int] = (1024, 2048), repeats: int = 5) -> dict[str, Any]:
    """Best-of fp32 torch.mm rate (GFLOP/s) with the current thread count: the
    denominator of model FLOP utilization. Best-of, because a busy neighbour can
    only make a repetition slower."""
    per_size: dict[str, float] = {}
    for n in sizes:
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        per_size[str(n)] = 2 * n**3 / best / 1e9
    return {"best_gflops": max(per_size.values()), "gflops_by_size": per_size, "repeats": repeats}


def percentiles_ms(values_s: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """p50/p90/p99 of durations given in seconds, in milliseconds (linear interpolation)."""
    if not values_s:
        return {f"p{q}": None for q in qs}
    points = np.percentile(np.asarray(values_s, dtype=np.float64) * 1e3, list(qs))
    return {f"p{q}": round(float(v), 3) for q, v in zip(qs, points)}


def number_cell(value: float | None, digits: int = 1, suffix: str = "", sign: bool = False) -> str:
    """A table cell: value to `digits` decimals (signed when asked), or n/a for a figure a run did not have."""
    return "n/a" if value is None else f"{value:{'+' if sign else ''}.{digits}f}{suffix}"


def table_lines(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, its separator (`align`: "l" or "r" per column) and one
    line per row, each cell written with str()."""
    separators = {"l": "---", "r": "---:"}
    return [f"| {' | '.join(header)} |", f"|{'|'.join(separators[a] for a in align)}|",
            *(f"| {' | '.join(map(str, row))} |" for row in rows)]


def percentiles_cell(values: dict[str, float | None], keys: Sequence[str], digits: int, sign: bool = False) -> str:
    """The percentiles named by keys as one "p50 / p99"-style table cell."""
    return " / ".join(number_cell(values[k], digits, sign=sign) for k in keys)


def ensure_model(preset: str, family: str = "llama", seed: int = 0, cache_dir: Path = MODEL_CACHE) -> Path:
    """The model directory for (family, preset, seed), made on first use and
    remade when tiny_model's config for it has changed since."""
    out = cache_dir / f"{family}-{preset}-seed{seed}"
    expected = model_config(family, preset)
    config_path = out / "config.json"
    has_weights = any(out.glob("*.safetensors"))
    if has_weights and config_path.exists() and json.loads(config_path.read_text()) == expected:
        return out
    progress(f"making {family}/{preset} model in {out}")
    return make_tiny_model(out, family, preset, seed=seed)


def results_json(results: Any) -> str:
    """The results as JSON, with every path inside the repository written relative to its root, so a
    results file names the machine but holds none of its absolute paths."""

    def portable(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: portable(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [portable(item) for item in value]
        if isinstance(value, str) and value.startswith(f"{REPO_ROOT}/"):
            return value[len(str(REPO_ROOT)) + 1:]
        return value

    return json.dumps(portable(results), indent=2) + "\n"


def bench_parser(description: str | None, quick: str, epilog: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring as written, how long the full run takes,
    --quick, the smoke run (`quick` says what it runs), and --out, where its results go."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=epilog)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="output directory (default bench/results)")
    return parser


def subplots(rows: int, cols: int, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A figure of rows x cols panels drawn off screen (the Agg backend: benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=figsize)


def save_figure(fig: Any, path: Path, dpi: int = 120, rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay out a benchmark's figure (within `rect`, leaving room for a figure legend), write it and
    close it: pyplot keeps every figure it made until it is closed."""
    import matplotlib.pyplot as plt  # the benchmark chose the backend when it imported pyplot

    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def save_with_legend_below(fig: Any, ax: Any, title: str, path: Path) -> None:
    """A figure of several panels sharing their series: `ax`'s legend once below them all, `title`
    above, then written (save_figure)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, rect=(0, 0.07, 1, 1))


def side_by_side(ticks: int, series: int, index: int) -> tuple[list[float], float]:
    """x positions and width of bar series `index` of `series` drawn side by side at ticks 0, 1, ...
    (together they fill 0.8 of each tick's slot, centred on it)."""
    width = 0.8 / series
    return [j + (index - (series - 1) / 2) * width for j in range(ticks)], width


def bar_chart(path: Path, labels: Sequence[str], series: dict[str, list[float]], ylabel: str, title: str,
              figsize: tuple[float, float] = (6, 4)) -> None:
    """A figure of one panel: each series' bars side by side at each label (percentile_bars), with a
    legend of the series, the y label and the title, written to `path` (save_figure)."""
    import matplotlib.pyplot as plt  # the benchmark chose the backend when it imported pyplot

    fig, ax = plt.subplots(figsize=figsize)
    percentile_bars(ax, labels, series)
    ax.legend()
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    save_figure(fig, path)


def percentile_bars(ax: Any, ticks: Sequence[str], series: dict[str, list[Any]], colors: Sequence[str] | None = None,
                    markers: dict[str, str] | None = None) -> list[Any]:
    """Bar series side by side at each tick (a legend label and a color each, by default the style's
    cycle); returns the bar containers. A value is a number (the bar's height), a percentile dict
    (p50 the bar, and each percentile of `markers` a black marker of its kind, e.g. {"p99": "x"}) or
    None (no bar there)."""
    containers = []
    for k, (name, values) in enumerate(series.items()):
        color = colors[k] if colors is not None else None
        positions, width = side_by_side(len(ticks), len(series), k)
        shown = [(x, value) for x, value in zip(positions, values) if value is not None]
        heights = [(value["p50"] or 0.0) if isinstance(value, dict) else value for _, value in shown]
        containers.append(ax.bar([x for x, _ in shown], heights, width, label=name, color=color))
        for percentile, marker in (markers or {}).items():
            points = [(x, value[percentile] or 0.0) for x, value in shown if isinstance(value, dict)]
            if points:
                ax.scatter(*zip(*points), marker=marker, color="black", s=18, zorder=3)
    ax.set_xticks(range(len(ticks)), ticks)
    return containers


def write_results(
    results: dict[str, Any],
    out: Path,
    name: str,
    quick: bool,
    plot: Callable[[dict[str, Any], Path], None],
    table: Callable[[dict[str, Any]], str],
) -> None:
    """Record the load average at the end in results["machine"] (a file of several runs, as
    host_overhead's, has a machine per run, each with its own), write <name>[_quick].json and .png
    under `out` and print the markdown table (--quick runs get their own files, so they never
    overwrite a full run)."""
    if "machine" in results:
        results["machine"]["load_average_at_end"] = load_average()
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_quick" if quick else name
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    json_path.write_text(results_json(results))
    plot(results, png_path)
    progress(f"wrote {json_path} and {png_path}")
    print(table(results))


def bench_main(name: str, parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
               run: Callable[[argparse.Namespace], dict[str, Any]], plot: Callable[[dict[str, Any], Path], None],
               table: Callable[[dict[str, Any]], str]) -> Callable[[Sequence[str] | None], None]:
    """The main(argv) of a benchmark that runs once: parse its arguments, run it and write the results
    as <name>[_quick] (write_results; _quick when it has --quick and it was given)."""

    def main(argv: Sequence[str] | None = None) -> None:
        args = parse_args(argv)
        write_results(run(args), args.out, name, getattr(args, "quick", False), plot, table)

    return main
