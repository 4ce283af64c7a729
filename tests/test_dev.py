"""`genq dev`, run the way the README's `make run` runs it: it streams the demo
and a SIGINT stops it and everything it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENQ = Path(sys.executable).parent / "genq"


def test_genq_dev_streams_the_demo_and_exits_cleanly_on_sigint(tmp_path: Path):
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
    assert "started a private redis-server" in log and "demo done: finish_reason=length, 16 tokens" in log
    assert re.search(r"Flower: http://127\.0\.0\.1:\d+/", log)
    assert stdout.startswith("Once upon a time") and len(stdout.strip()) > len("Once upon a time")
    pids = [int(pid) for pid in re.findall(r"=(\d+)", re.search(r"processes: (.*)", log).group(1))]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
