"""service_ceiling.py's gateway part: N concurrent OpenAI SSE streams through a real `genq gateway`
in front of a synthetic-engine worker, with each process's CPU counted."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from worker.processes import ChildProcess, free_port, genq_command, wait_until

MODEL = "genq"
"""The gateway's default model name (GENQ_GATEWAY_MODEL_NAME): the queue's workers."""
TOKEN = "bench-token"


def start_gateway(redis_url: str, queue: str, streams: int, log_path: Path) -> tuple[ChildProcess, str]:
    """`genq gateway` on a free port, open to `streams` streams from one client; its URL once /healthz answers."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}, "PYTHONUNBUFFERED": "1",
           "GENQ_REDIS_URL": redis_url, "GENQ_QUEUE": queue, "GENQ_GATEWAY_TOKEN": TOKEN,
           "GENQ_GATEWAY_MAX_STREAMS_PER_CLIENT": str(streams), "GENQ_GATEWAY_MAX_STREAMS_PER_TASK": str(streams)}
    gateway = ChildProcess("gateway", genq_command("gateway", "--port", str(port)), log_path, env).start()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        gateway.check_alive()
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 60, "the gateway to answer /healthz")
    except BaseException:
        gateway.stop()
        raise
    return gateway, url


async def _stream(client: httpx.AsyncClient, url: str, new_tokens: int) -> tuple[int, str]:
    """One streamed completion: its completion tokens (the usage chunk) and its text."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": new_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            texts.extend(choice["text"] for choice in chunk.get("choices", []))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, "".join(texts)


async def _stream_or_failure(client: httpx.AsyncClient, url: str, new_tokens: int) -> tuple[int, str] | str:
    """A completion, or what broke its stream (counted, never retried: a benchmark reports it)."""
    try:
        return await _stream(client, url, new_tokens)
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"


async def _streams(url: str, streams: int, requests: int, new_tokens: int) -> list[tuple[int, str] | str]:
    """`requests` completions, `streams` of them open at once."""
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    gate = asyncio.Semaphore(streams)
    async with httpx.AsyncClient(limits=limits, timeout=600, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        async def one() -> tuple[int, str] | str:
            async with gate:
                return await _stream_or_failure(client, url, new_tokens)

        return await asyncio.gather(*(one() for _ in range(requests)))


def run_streams(url: str, streams: int, requests: int, new_tokens: int) -> dict[str, Any]:
    """Tokens, wall time and texts of the completions, streamed `streams` at a time."""
    start = time.perf_counter()
    done = asyncio.run(_streams(url, streams, requests, new_tokens))
    wall_s = time.perf_counter() - start
    finished = [outcome for outcome in done if isinstance(outcome, tuple)]
    failures = [outcome for outcome in done if isinstance(outcome, str)]
    texts = [text for _, text in finished]
    return {"tokens": sum(tokens for tokens, _ in finished), "wall_s": wall_s, "texts_alike": len(set(texts)) == 1,
            "completed": sum(tokens == new_tokens for tokens, _ in finished), "failed": len(failures),
            "failures": sorted(set(failures))}
