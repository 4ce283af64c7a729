"""One command that accepts a GPU for genq (`make gpu-check`).

    python bench/gpu_acceptance.py                 # writes bench/results/gpu_acceptance.{json,png}

Sections (docs/gpu.md, "Accepting a GPU", says what each figure means):
  dry_run         the GPU dry run on fake CUDA tensors (tests/test_gpu_dry_run.py, tests/test_host_syncs.py);
                  runs on any machine
  parity          the engine vs transformers, both bf16 on the device: last-position logits within 3% of
                  the row's largest |logit|, greedy tokens equal except a flip at a near-tie
  kernels         every Triton kernel against its torch reference, compiled on the device
                  (tests/kernel_checks.py's groups)
  attention_speed paged attention decode vs torch's scaled_dot_product_attention, and as a fraction of
                  the HBM roofline (bytes read / peak bandwidth)
  decode          decode tokens/s at each --batches size on Llama-3.1-8B shapes with random weights,
                  with and without CUDA graphs, and as a fraction of the roofline
  burst           --burst-tasks requests at once through a real `genq worker` (tiny model): throughput
                  and p50/p99 time to first token
Without a CUDA device only dry_run runs; every other section is written as {"skipped": "no CUDA
device", ...}: nothing is estimated. A section that raises is written as {"error": ..., "traceback": [...]}
and the rest still run. Exits 1 when a check (dry_run, parity, kernels, burst) fails or raises.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from bench_common import REPO_ROOT, RESULTS_DIR, progress, results_json  # noqa: E402
from gpu_roofline import peak_bandwidth_gbps  # noqa: E402

DRY_RUN_TESTS = ("tests/test_gpu_dry_run.py", "tests/test_host_syncs.py")
NO_DEVICE = "no CUDA device"
#: what each GPU section would have measured, said where it could not be
NEEDS_DEVICE = {
    "parity": "engine vs transformers logits and greedy tokens in bf16 on the device",
    "kernels": "the Triton kernels compiled for the device against their torch references",
    "attention_speed": "paged attention decode time vs scaled_dot_product_attention and the HBM roofline",
    "decode": "decode tokens/s on Llama-3.1-8B shapes with and without CUDA graphs, vs the HBM roofline",
    "burst": "throughput and time to first token of a burst through a real worker",
}
CHECKS = ("dry_run", "parity", "kernels", "burst")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help="directory for gpu_acceptance.json and .png (default: bench/results)")
    parser.add_argument("--peak-bandwidth", type=float, default=None, metavar="GB/S",
                        help="the GPU's peak memory bandwidth in GB/s (default: gpu_roofline's table by device name; "
                             "a card missing from it gets no roofline fractions without this)")
    parser.add_argument("--dry-run-select", default=None, metavar="EXPR",
                        help="pytest -k expression choosing dry-run tests (default: all of them)")
    parser.add_argument("--skip", action="append", default=[], choices=sorted(NEEDS_DEVICE),
                        help="leave a GPU section out (repeatable); it is written as skipped")
    parser.add_argument("--parity-prompts", type=int, default=16, help="prompts compared with transformers")
    parser.add_argument("--parity-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64, 256],
                        help="decode batch sizes, comma-separated (default: 1,16,64,256)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding job")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--burst-tasks", type=int, default=256, help="requests in the worker burst")
    parser.add_argument("--burst-prompt", type=int, default=128, help="prompt tokens of each burst request")
    parser.add_argument("--burst-tokens", type=int, default=64, help="new tokens of each burst request")
    return parser.parse_args(argv)


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def machine() -> dict[str, Any]:
    """What ran the check: the GPU, its driver and CUDA, torch (no paths)."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "date": datetime.now(UTC).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    driver=_nvidia_smi("driver_version"))
    else:
        info.update(gpu=None, cuda=torch.version.cuda, driver=None)
    return info


def dry_run(select: str | None) -> dict[str, Any]:
    """The dry-run test files under pytest, in a child process (they load a compiled fake CUDA guard)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DRY_RUN_TESTS]
    if select:
        command += ["-k", select]
    progress(f"dry run: pytest {' '.join(command[6:])}")
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    # pytest reports a conftest or plugin that fails to import on stderr only
    summary = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    progress(f"dry run: {summary}")
    return {"passed": proc.returncode == 0, "tests": list(DRY_RUN_TESTS), "select": select, "summary": summary}


def guarded(section: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The section's result, or the error it raised: a first run on a new card must still measure the
    sections after one that fails. The result goes to the log too, so a run cut short keeps its figures."""
    start = time.perf_counter()
    try:
        result = measure()
    except Exception as error:
        lines = traceback.format_exc().replace(f"{REPO_ROOT}/", "").splitlines()[-30:]
        result = {"error": f"{type(error).__name__}: {error}", "traceback": lines}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what this process cached stays free for the next section (the burst's worker)
    progress(f"{section}: done in {time.perf_counter() - start:.1f} s: {json.dumps(result, default=str)}")
    return result


def run_sections(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import gpu_sections as gs

    sections: dict[str, Any] = {"dry_run": guarded("dry_run", lambda: dry_run(args.dry_run_select))}
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name() if on_gpu else ""
    bandwidth = peak_bandwidth_gbps(name, args.peak_bandwidth) if on_gpu else None
    sections["peak_bandwidth_gbps"] = bandwidth
    measures: dict[str, Callable[[], dict[str, Any]]] = {
        "parity": lambda: gs.parity(workdir, device, args.parity_prompts, args.parity_tokens),
        "kernels": gs.kernel_checks,
        "attention_speed": lambda: gs.attention_speed(bandwidth),
        "decode": lambda: gs.decode_throughput(workdir, device, args.batches, args.context, args.decode_steps,
                                               bandwidth),
        "burst": lambda: gs.worker_burst(workdir, args.burst_tasks, args.burst_prompt, args.burst_tokens),
    }
    for section, measure in measures.items():
        if not on_gpu or section in args.skip:
            reason = NO_DEVICE if not on_gpu else "left out with --skip"
            progress(f"{section}: skipped ({reason}): not measured: {NEEDS_DEVICE[section]}")
            sections[section] = {"skipped": reason, "not_measured": NEEDS_DEVICE[section]}
            continue
        progress(f"{section}: {NEEDS_DEVICE[section]}")
        sections[section] = guarded(section, measure)
    if on_gpu and bandwidth is None:
        progress(f"no peak bandwidth known for {name}: pass --peak-bandwidth for roofline fractions")
    return sections


def _not_shown(section: dict[str, Any]) -> str:
    """Why a section has no rows to plot: skipped, or the error it raised."""
    return f"error ({section['error'][:80]})" if "error" in section else f"skipped ({section['skipped']})"


def plot(results: dict[str, Any], path: Path) -> None:
    """Decode tokens/s by batch (graphs on and off, the roofline), and attention time vs SDPA; on a
    machine without a GPU, a figure that says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode, attention = results["sections"]["decode"], results["sections"]["attention_speed"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if "rows" in decode:
        for graphs in (False, True):
            rows = [r for r in decode["rows"] if r["cuda_graphs"] is graphs]
            left.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], "o-",
                      label=f"CUDA graphs {'on' if graphs else 'off'}")
        roof = [r for r in decode["rows"] if not r["cuda_graphs"] and r["roofline_tokens_per_s"]]
        if roof:
            left.plot([r["batch"] for r in roof], [r["roofline_tokens_per_s"] for r in roof], "k--",
                      label="HBM roofline")
        left.set_xscale("log", base=2)
        left.set_yscale("log")
        left.legend()
    else:
        left.text(0.5, 0.5, f"decode: {_not_shown(decode)}", ha="center", va="center")
    left.set(title="decode, Llama-3.1-8B shapes, bf16", xlabel="batch", ylabel="tokens/s")
    if "rows" in attention:
        labels = [f"{r['batch']}x{r['context']}" for r in attention["rows"]]
        xs = range(len(labels))
        right.bar([x - 0.2 for x in xs], [r["paged_attention_ms"] for r in attention["rows"]], 0.4,
                  label="paged (Triton)")
        right.bar([x + 0.2 for x in xs], [r["sdpa_gathered_ms"] for r in attention["rows"]], 0.4,
                  label="SDPA, cache pre-gathered")
        right.set_xticks(list(xs), labels)
        right.legend()
    else:
        right.text(0.5, 0.5, f"attention: {_not_shown(attention)}", ha="center", va="center")
    right.set(title="attention decode (batch x context)", ylabel="ms")
    fig.suptitle(f"genq GPU acceptance: {results['machine']['gpu'] or 'no GPU (dry run only)'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    progress("machine: " + (torch.cuda.get_device_name() if torch.cuda.is_available() else f"{NO_DEVICE} (CPU)"))
    with tempfile.TemporaryDirectory(prefix="genq-gpu-acceptance-") as tmp:
        sections = run_sections(args, Path(tmp))
    failed = [name for name in CHECKS if sections[name].get("passed") is False or "error" in sections[name]]
    info = machine()
    # passed: every check that ran passed; on a machine without a GPU that is the dry run alone
    results = {"machine": info, "gpu_measured": info["gpu"] is not None, "passed": not failed, "failed": failed,
               "sections": sections}
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "gpu_acceptance.json", args.out / "gpu_acceptance.png"
    json_path.write_text(results_json(results))
    plot(results, png_path)
    shown = [str(p.relative_to(REPO_ROOT)) if p.resolve().is_relative_to(REPO_ROOT) else p.name
             for p in (json_path, png_path)]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "every check that ran passed"
    progress(f"wrote {' and '.join(shown)}; {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
