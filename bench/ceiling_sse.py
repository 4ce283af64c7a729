"""service_ceiling.py's gateway part: N concurrent OpenAI SSE streams through a real `genq gateway`
in front of a synthetic-engine worker, the client in processes of its own (bench/sse_client.py),
with each process's CPU counted.

What 1,000 streams need of the machine and the services, and what this harness sets:
- file descriptors: the gateway holds a socket per stream, a client process one per stream it
  drives; the soft RLIMIT_NOFILE is raised to the hard limit here, before any child starts (they
  inherit it);
- the gateway's stream caps (GENQ_GATEWAY_MAX_STREAMS_PER_CLIENT / _PER_TASK, 64 and 16 by
  default, one client being one credential from one address): set to the stream count;
- its header timeout (GENQ_GATEWAY_HEADER_TIMEOUT_S, 10 s): 1,000 connections opened at once on
  two shared cores take longer than that to send their headers (the client's event loop is busy
  with the streams already open, the gateway's with writing them), and the gateway answers 408;
  HEADER_TIMEOUT_S here. A deployment whose clients arrive a thousand at once on one gateway
  process needs the same, or more gateway processes;
- httpx: one connection per stream (max_connections = the streams of a process).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from sse_client import TOKEN, ClientJob

from worker.processes import ChildProcess, free_port, genq_command

HEADER_TIMEOUT_S = 120
CLIENT_SCRIPT = Path(__file__).resolve().parent / "sse_client.py"
WARM_TOKENS = 8
T = TypeVar("T")


def raise_open_files_limit() -> dict[str, int]:
    """The soft RLIMIT_NOFILE raised to the hard one (children inherit it); both, as set."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"soft": soft, "hard": hard}


def start_gateway(redis_url: str, queue: str, streams: int, coalesce_ms: int, log_path: Path
                  ) -> tuple[ChildProcess, str]:
    """`genq gateway` on a free port, open to `streams` streams from one client, coalescing OpenAI
    streams every `coalesce_ms` (GENQ_GATEWAY_STREAM_COALESCE_MS); its URL once /healthz answers."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}, "PYTHONUNBUFFERED": "1",
           "GENQ_REDIS_URL": redis_url, "GENQ_QUEUE": queue, "GENQ_GATEWAY_TOKEN": TOKEN,
           "GENQ_GATEWAY_MAX_STREAMS_PER_CLIENT": str(streams), "GENQ_GATEWAY_MAX_STREAMS_PER_TASK": str(streams),
           "GENQ_GATEWAY_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
           "GENQ_GATEWAY_STREAM_COALESCE_MS": str(coalesce_ms)}
    gateway = ChildProcess("gateway", genq_command("gateway", "--port", str(port)), log_path, env)
    url = f"http://127.0.0.1:{port}"
    return gateway.start_until(lambda: gateway.serves_health(url), 60, "the gateway to answer /healthz"), url


def _line(process: subprocess.Popen[str], what: str) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"an SSE client process ended before {what} (exit status {process.wait()})")
    return line


def run_clients(jobs: list[ClientJob], snapshot: Callable[[], T]) -> tuple[T, list[dict[str, Any]], T]:
    """One client process per job: each warms up, then all run their measured round at once;
    `snapshot()` is taken once every process is ready and again once all have reported."""
    processes = [subprocess.Popen([sys.executable, str(CLIENT_SCRIPT), json.dumps(asdict(job)), str(WARM_TOKENS)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for job in jobs]
    try:
        for process in processes:
            _line(process, "its warm-up ended")
        before = snapshot()
        for process in processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        reports = [json.loads(_line(process, "its report")) for process in processes]
        after = snapshot()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    return before, reports, after


def combined(reports: list[dict[str, Any]], new_tokens: int) -> dict[str, Any]:
    """The client processes' reports as one: tokens, wall time (first start to last end), CPU,
    texts, and the latency samples."""
    failures = sorted({failure for report in reports for failure in report["failures"]})
    texts = {text for report in reports for text in report["texts"]}
    return {"tokens": sum(r["tokens"] for r in reports), "completed": sum(r["completed"] for r in reports),
            "failed": sum(r["failed"] for r in reports), "failures": failures, "texts_alike": len(texts) == 1,
            "wall_s": max(r["end"] for r in reports) - min(r["start"] for r in reports),
            "cpu_s": sum(r["cpu_s"] for r in reports), "text_chunks": sum(r["text_chunks"] for r in reports),
            "first_text_s": [s for r in reports for s in r["first_text_s"]],
            "intervals_s": [s for r in reports for s in r["intervals_s"]], "new_tokens": new_tokens}


def client_jobs(url: str, streams: int, requests: int, new_tokens: int, processes: int,
                coalesce_ms: int | None) -> list[ClientJob]:
    """`streams` streams and `requests` requests shared out over `processes` client processes."""
    def share(total: int, i: int) -> int:
        return total // processes + (i < total % processes)

    return [ClientJob(url, share(streams, i), share(requests, i), new_tokens, coalesce_ms)
            for i in range(processes) if share(streams, i)]
