"""Progress of model loading, for `Generator.from_pretrained(..., progress=...)`.

Loading a checkpoint reports `progress(done, total)` once per safetensors shard
or, for a GGUF file, once per tensor (hundreds of calls). On a terminal a bar
redrawn in place is what a person watches; in a log (a worker under a process
manager) one line per tenth is enough, so `LoadProgress` does whichever fits
its stream.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

BAR_WIDTH = 30


class LoadProgress:
    """A `progress(done, total)` callback: a bar on a TTY, else a log line per 10%."""

    def __init__(self, what: str = "loading weights", stream: TextIO | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.logger = logger or logging.getLogger("engine.loading")
        self.interactive = self.stream.isatty()
        self.started = time.monotonic()
        self._logged_tenth = -1

    def __call__(self, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        elapsed = time.monotonic() - self.started
        if self.interactive:
            filled = int(BAR_WIDTH * fraction)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{self.what} [{bar}] {done}/{total} {fraction:4.0%} {elapsed:5.1f} s{end}")
            self.stream.flush()
            return
        tenth = int(fraction * 10)
        if tenth > self._logged_tenth:
            self._logged_tenth = tenth
            self.logger.info("%s: %d/%d (%.0f%%, %.1f s)", self.what, done, total, 100 * fraction, elapsed)
