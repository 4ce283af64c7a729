"""Celery integration of the engine: a worker bootstep that loads the model
once and runs the engine loop, its stats in `celery inspect stats` (and so in
Flower), an `engine_stats` inspect command, and warm-shutdown handling."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, bootsteps
from celery.signals import worker_shutting_down
from celery.worker.control import inspect_command

from engine.errors import ModelLoadError
from worker import runtime as runtime_module
from worker.runtime import Runtime

log = logging.getLogger(__name__)
#: The worker's exit status when its model cannot be loaded (non-zero, so `restart: on-failure`
#: retries, and distinct from Celery's 1 for other failures).
EXIT_MODEL_UNUSABLE = 3


class EngineStep(bootsteps.StartStopStep):
    """Owns the Runtime for the worker's lifetime. The threads pool has no
    worker_process_init, so the model loads here, once per worker process."""

    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.runtime: Runtime | None = None

    def start(self, parent: Any) -> None:
        try:
            self.runtime = Runtime.start(parent.app.genq_settings, parent.app.backend, parent.hostname)
        except (ModelLoadError, FileNotFoundError) as error:
            # The operator's to fix (a bad path or file): one line that says what, not Celery's
            # "Unrecoverable error" traceback. SystemExit makes Celery stop with this status.
            log.critical("cannot load the model: %s", error)
            raise SystemExit(EXIT_MODEL_UNUSABLE) from None
        runtime_module.install(self.runtime)

    def stop(self, parent: Any) -> None:
        if self.runtime is not None:
            self.runtime.stop()

    def info(self, parent: Any) -> dict[str, Any]:
        return {"engine": self.runtime.loop.stats() if self.runtime is not None else {"loading": True}}


@inspect_command()
def engine_stats(state: Any) -> dict[str, Any]:
    """`celery inspect engine_stats`: the engine's pages, jobs and throughput."""
    return runtime_module.current(timeout=0).loop.stats()


def _on_shutting_down(sig: Any = None, how: str | None = None, exitcode: int | None = None, **_: Any) -> None:
    """Warm shutdown: stop taking jobs and give in-flight ones the grace period;
    what is still running then is requeued for another worker."""
    try:
        runtime = runtime_module.current(timeout=0)
    except RuntimeError:
        return
    if how == "Warm":
        log.info("warm shutdown: finishing in-flight jobs for up to %.0f s", runtime.settings.shutdown_grace_s)
        runtime.loop.begin_shutdown(runtime.settings.shutdown_grace_s)
    else:
        runtime.loop.begin_shutdown(0.0)


def install(app: Celery) -> None:
    app.steps["worker"].add(EngineStep)
    worker_shutting_down.connect(_on_shutting_down, weak=False)
