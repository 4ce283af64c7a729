"""The SSE client of service_ceiling.py's gateway part: OpenAI streamed completions over httpx,
run in processes of their own (ceiling_sse.py starts them) so that the gateway's CPU figure is
its own and the client's is counted apart. Each stream records when its chunks came, for the
latency cost of coalescing: time to the first text, and the intervals between text chunks.

Imports only httpx and the standard library: a client process starts in a fraction of a second."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "genq"
"""The gateway's default model name (GENQ_GATEWAY_MODEL_NAME): the queue's workers."""
TOKEN = "bench-token"


@dataclass
class StreamTrace:
    """One completion: its completion tokens (the usage chunk), its text, and when (perf_counter
    seconds after its request was sent) each chunk with text arrived."""

    tokens: int = 0
    texts: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ClientJob:
    """What one client process runs: `requests` completions of `new_tokens`, `streams` at once,
    with stream_options.coalesce_ms when given."""

    url: str
    streams: int
    requests: int
    new_tokens: int
    coalesce_ms: int | None = None


async def _stream(client: httpx.AsyncClient, job: ClientJob) -> StreamTrace:
    stream_options: dict[str, Any] = {"include_usage": True}
    if job.coalesce_ms is not None:
        stream_options["coalesce_ms"] = job.coalesce_ms
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": job.new_tokens, "stream": True,
            "stream_options": stream_options}
    trace = StreamTrace()
    start = time.perf_counter()
    async with client.stream("POST", f"{job.url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            text = "".join(choice["text"] for choice in chunk.get("choices", []))
            if text:
                trace.texts.append(text)
                trace.arrivals.append(time.perf_counter() - start)
            if chunk.get("usage"):
                trace.tokens = chunk["usage"]["completion_tokens"]
    return trace


async def _stream_or_failure(client: httpx.AsyncClient, job: ClientJob) -> StreamTrace | str:
    """A completion, or what broke its stream (counted, never retried: a benchmark reports it)."""
    try:
        return await _stream(client, job)
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"


async def _streams(job: ClientJob) -> list[StreamTrace | str]:
    limits = httpx.Limits(max_connections=job.streams, max_keepalive_connections=job.streams)
    gate = asyncio.Semaphore(job.streams)
    async with httpx.AsyncClient(limits=limits, timeout=600, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        async def one() -> StreamTrace | str:
            async with gate:
                return await _stream_or_failure(client, job)

        return await asyncio.gather(*(one() for _ in range(job.requests)))


def summary(outcomes: list[StreamTrace | str], new_tokens: int) -> dict[str, Any]:
    """What the parent needs of a process's streams: counts, texts, and the latency samples."""
    finished = [o for o in outcomes if isinstance(o, StreamTrace)]
    failures = [o for o in outcomes if isinstance(o, str)]
    return {"tokens": sum(t.tokens for t in finished), "completed": sum(t.tokens == new_tokens for t in finished),
            "failed": len(failures), "failures": sorted(set(failures)),
            "texts": sorted({"".join(t.texts) for t in finished}),
            "text_chunks": sum(len(t.texts) for t in finished),
            "first_text_s": [t.arrivals[0] for t in finished if t.arrivals],
            "intervals_s": [b - a for t in finished for a, b in zip(t.arrivals, t.arrivals[1:])]}


def main() -> None:
    """A client process (ceiling_sse.run_clients): the job as JSON in argv[1]; a warm-up round of
    `job.streams` completions of argv[2] tokens; then `ready` on stdout, and once a line comes on
    stdin, the measured round: its summary as JSON on stdout, with this process's wall-clock span
    (time.time, comparable across processes) and CPU seconds."""
    job = ClientJob(**json.loads(sys.argv[1]))
    warm = ClientJob(job.url, job.streams, job.streams, int(sys.argv[2]), job.coalesce_ms)
    asyncio.run(_streams(warm))
    print("ready", flush=True)
    sys.stdin.readline()
    cpu, start = time.process_time(), time.time()
    outcomes = asyncio.run(_streams(job))
    end = time.time()
    print(json.dumps({**summary(outcomes, job.new_tokens), "start": start, "end": end,
                      "cpu_s": time.process_time() - cpu}), flush=True)


if __name__ == "__main__":
    main()
