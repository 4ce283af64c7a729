"""The worker's CPU per request outside the engine's per-token work (issue 30): Celery receiving
and acknowledging the task, its events and result writes, genq's delivery checks (worker/delivery.py),
parsing, tokenizing and building the job, the request's started and final events.

A real `genq worker` with the synthetic engine (engine/synthetic.py) at a GPU-like step
(--synthetic-step-ms 15, a rate so high the batch adds nothing) takes short requests (a text prompt
the worker tokenizes, --tokens new tokens each, so the per-token work is small beside the request's),
sent by a broker-only Celery client in two ways: paced at --rate new requests/s, and all at once (a
burst, the intake's ceiling: requests/s from the first send to the last acknowledgement). Per
request: the worker's CPU seconds (user and system, /proc/PID/stat, read once every request is
acknowledged: Redis's `unacked` hash empty) and Redis commands (INFO commandstats, every client,
a script's own commands included).

With --baseline REV the same runs go through a worker of git revision REV too (its tree exported
with `git archive` into a temporary directory, the worker started with PYTHONSAFEPATH=1 and
PYTHONPATH naming that tree), alternating baseline and this tree for --rounds rounds on one Redis,
so both see the same machine; the figures are the rounds' means (min–max in the JSON).
Writes <out>/worker_intake.json and .png (worker_intake_quick.* with --quick) and prints a table.
Needs redis-server on the PATH.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend
import redis  # noqa: E402
from bench_common import (  # noqa: E402
    REPO_ROOT,
    bench_main,
    bench_parser,
    ensure_model,
    measured_when,
    progress,
    save_figure,
    start_run,
    table_lines,
)
from celery import Celery  # noqa: E402
from service_runners import install_sigterm_as_interrupt  # noqa: E402
from stream_commands import command_calls  # noqa: E402

from producer.protocol import TASK_NAME  # noqa: E402
from worker.processes import RedisServer, WorkerProcess, wait_until  # noqa: E402

STEP_MS = 15.0
SYNTHETIC_RATE = 10_000_000
WORKER_SLOTS = 192
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife."
TOKENS = 4
RATE = 100.0
REQUESTS = 600
QUICK_REQUESTS = 200
ROUNDS = 2
WARM_REQUESTS = 20
TIMEOUT_S = 300.0
QUEUE = "genq-intake"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, quick=f"{QUICK_REQUESTS} requests a run, one round; writes worker_intake_quick.*",
                          epilog="A few minutes with --baseline; run it on a quiet machine.")
    parser.add_argument("--baseline", default=None, help="a git revision whose worker runs beside this tree's")
    parser.add_argument("--rate", type=float, default=RATE, help=f"paced new requests/s (default {RATE:g})")
    parser.add_argument("--requests", type=int, default=None, help=f"requests a run (default {REQUESTS})")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"new tokens a request (default {TOKENS})")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds of every tree (default {ROUNDS})")
    args = parser.parse_args(argv)
    args.requests = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    args.rounds = args.rounds or (1 if args.quick else ROUNDS)
    return args


def export_tree(revision: str, into: Path) -> str:
    """REV's files under `into`; returns the commit it names."""
    commit = subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO_ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=REPO_ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def worker_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def send(sender: Celery, name: str, count: int, rate: float | None, tokens: int) -> None:
    """`count` requests, paced at `rate` a second (a late send is not made up by a burst), or all at once."""
    due = time.monotonic()
    for i in range(count):
        sender.send_task(TASK_NAME, queue=QUEUE, kwargs={
            "prompt": PROMPT, "max_new_tokens": tokens, "ignore_eos": True, "sampling": {"temperature": 0},
            "identifier": f"{name}-{i}"})
        if rate is not None:
            due = max(due + 1 / rate, time.monotonic())
            time.sleep(max(0.0, due - time.monotonic()))  # the pacing itself: a schedule, not an event


def settled(admin: redis.Redis, worker: WorkerProcess, celery: Celery, expected: int) -> bool:
    """Every request completed by the engine and acknowledged by Celery (kombu's unacked hash empty)."""
    stats = worker.engine_stats(celery) or {}
    return stats.get("completed", 0) >= expected and admin.hlen("unacked") == 0


def measure(admin: redis.Redis, celery: Celery, sender: Celery, worker: WorkerProcess, name: str,
            rate: float | None, args: argparse.Namespace) -> dict[str, Any]:
    """One run of args.requests requests (paced at `rate`, or a burst when None)."""
    assert worker.pid is not None
    start = (worker.engine_stats(celery) or {})["completed"]
    expected = start + args.requests
    cpu_before, commands_before, wall_before = worker_cpu(worker.pid), command_calls(admin), time.monotonic()
    sending = threading.Thread(target=send, args=(sender, name, args.requests, rate, args.tokens))
    sending.start()
    sending.join()
    wait_until(lambda: settled(admin, worker, celery, expected), TIMEOUT_S, f"{args.requests} requests of {name}",
               interval=0.02)
    wall = time.monotonic() - wall_before
    cpu_after, commands_after = worker_cpu(worker.pid), command_calls(admin)
    user, system = (after - before for after, before in zip(cpu_after, cpu_before))
    # The measurement's own INFO calls and the settled() polling (HLEN, the engine_stats broadcast) included.
    calls = {name: count - commands_before.get(name, 0) for name, count in commands_after.items()}
    by_command = {name: round(count / args.requests, 2)
                  for name, count in sorted(calls.items(), key=lambda item: -item[1]) if count}
    figures = {"requests": args.requests, "wall_s": round(wall, 3), "requests_per_s": round(args.requests / wall, 1),
               "cpu_ms_per_request": round(1000 * (user + system) / args.requests, 3),
               "user_ms_per_request": round(1000 * user / args.requests, 3),
               "system_ms_per_request": round(1000 * system / args.requests, 3),
               "redis_commands_per_request": round(sum(calls.values()) / args.requests, 2),
               "redis_commands_per_request_by_command": by_command}
    progress(f"{name}: {figures['requests_per_s']} requests/s, {figures['cpu_ms_per_request']} ms CPU and "
             f"{figures['redis_commands_per_request']} Redis commands a request")
    return figures


def run_tree(tree: Path | None, label: str, round_: int, args: argparse.Namespace, model: Path,
             server: RedisServer, workdir: Path) -> dict[str, dict[str, Any]]:
    """A fresh worker of `tree` (None: this one): a warm-up, then a paced run and a burst."""
    admin = redis.Redis.from_url(server.url)
    celery = Celery("bench-client", broker=server.url, backend=server.url)
    sender = Celery("bench-sender", broker=server.url)
    options = {"synthetic_rate": SYNTHETIC_RATE, "synthetic_step_ms": STEP_MS, "concurrency": WORKER_SLOTS,
               "max_batch_size": WORKER_SLOTS}
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": str(tree or REPO_ROOT)}
    name = f"{label}-{round_}"
    with WorkerProcess(model, server.url, QUEUE, name, workdir / f"{name}.log", options, env=env) as worker:
        worker.wait_ready(celery)
        measure(admin, celery, sender, worker, f"{name}-warm", None,
                argparse.Namespace(**{**vars(args), "requests": WARM_REQUESTS}))
        return {"paced": measure(admin, celery, sender, worker, f"{name}-paced", args.rate, args),
                "burst": measure(admin, celery, sender, worker, f"{name}-burst", None, args)}


def summary(runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each mode's figures: the rounds' means, and their min and max."""
    out: dict[str, Any] = {}
    for mode in ("paced", "burst"):
        keys = [k for k in runs[0][mode] if k not in ("requests", "redis_commands_per_request_by_command")]
        out[mode] = {k: round(sum(r[mode][k] for r in runs) / len(runs), 3) for k in keys}
        out[mode]["range"] = {k: [min(r[mode][k] for r in runs), max(r[mode][k] for r in runs)] for k in keys}
        by_command = [r[mode]["redis_commands_per_request_by_command"] for r in runs]
        names = sorted({name for counts in by_command for name in counts},
                       key=lambda name: -sum(counts.get(name, 0) for counts in by_command))
        out[mode]["redis_commands_per_request_by_command"] = {
            name: round(sum(counts.get(name, 0) for counts in by_command) / len(runs), 2) for name in names}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    install_sigterm_as_interrupt()
    machine = start_run(1)
    model = ensure_model("tiny")
    with tempfile.TemporaryDirectory(prefix="genq-intake-") as tmp, \
            RedisServer(Path(tmp), persistence="none") as server:
        trees: list[tuple[str, Path | None]] = []
        baseline_commit = None
        if args.baseline is not None:
            base = Path(tmp) / "baseline"
            base.mkdir()
            baseline_commit = export_tree(args.baseline, base)
            trees.append(("baseline", base))
        trees.append(("this tree", None))
        runs: dict[str, list[dict[str, dict[str, Any]]]] = {label: [] for label, _ in trees}
        for round_ in range(args.rounds):
            for label, tree in trees:
                runs[label].append(run_tree(tree, label.replace(" ", "-"), round_, args, model, server, Path(tmp)))
    return {"benchmark": "worker_intake", "machine": machine, "baseline": baseline_commit,
            "step_ms": STEP_MS, "tokens_per_request": args.tokens, "paced_rate": args.rate,
            "requests_per_run": args.requests, "rounds": args.rounds,
            "trees": {label: {"runs": tree_runs, **summary(tree_runs)} for label, tree_runs in runs.items()}}


def markdown_table(results: dict[str, Any]) -> str:
    rows = []
    for label, tree in results["trees"].items():
        name = f"{label} ({results['baseline']})" if label == "baseline" else label
        for mode in ("paced", "burst"):
            f = tree[mode]
            rate = f"{results['paced_rate']:g}/s" if mode == "paced" else "all at once"
            rows.append([name, rate, f"{f['requests_per_s']:.0f}", f"{f['cpu_ms_per_request']:.2f}",
                         f"{f['user_ms_per_request']:.2f} / {f['system_ms_per_request']:.2f}",
                         f"{f['redis_commands_per_request']:.1f}"])
    header = ["worker", "sent", "requests/s through", "worker CPU ms / request", "user / system ms",
              "Redis commands / request"]
    note = (f"\n{results['tokens_per_request']} new tokens a request, {results['requests_per_run']} requests a run, "
            f"means of {results['rounds']} rounds; {measured_when(results['machine'])}")
    return "\n".join([*table_lines(header, "llrrrr", rows), note])


def plot(results: dict[str, Any], path: Path) -> None:
    trees = results["trees"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = list(trees)
    for ax, (key, title) in zip(axes, (("cpu_ms_per_request", "worker CPU ms per request"),
                                       ("requests_per_s", "requests/s through the worker"))):
        for offset, mode in ((-0.2, "paced"), (0.2, "burst")):
            ax.bar([i + offset for i in range(len(labels))], [trees[t][mode][key] for t in labels], width=0.4,
                   label=f"paced {results['paced_rate']:g}/s" if mode == "paced" else "burst")
        ax.set_xticks(range(len(labels)), labels)
        ax.set(title=title)
        ax.legend()
    fig.suptitle(f"{results['tokens_per_request']}-token requests through a synthetic-engine worker")
    save_figure(fig, path)


main = bench_main("worker_intake", parse_args, run, plot, markdown_table)

if __name__ == "__main__":
    main()
