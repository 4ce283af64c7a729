"""Celery integration of the engine: a worker bootstep that loads the model
once and runs the engine loop, its stats in `celery inspect stats` (and so in
Flower's worker page, readable), an `engine_stats` inspect command, Celery's
`revoke` extended to running generations, and warm-shutdown handling."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, bootsteps
from celery.signals import worker_shutting_down
from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import Panel, control_command, inspect_command, ok

from engine.errors import AdapterLoadError, ModelLoadError
from producer.protocol import TASK_NAME
from worker import runtime as runtime_module
from worker.delivery import identifier_of
from worker.loop import TOKENS_PER_SECOND_WINDOW_S
from worker.metrics import readable_stats
from worker.runtime import Runtime

log = logging.getLogger(__name__)
#: The worker's exit status when its model (or one of its --lora adapters) cannot be loaded
#: (non-zero, so `restart: on-failure` retries, and distinct from Celery's 1 for other failures).
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
            self.runtime = Runtime.start(parent.app.genq_settings, parent.hostname)
        except (ModelLoadError, FileNotFoundError) as error:
            # The operator's to fix (a bad path or file): one line that says what, not Celery's
            # "Unrecoverable error" traceback. SystemExit makes Celery stop with this status.
            log.critical("cannot load the model: %s", error)
            raise SystemExit(EXIT_MODEL_UNUSABLE) from None
        except AdapterLoadError as error:
            # A --lora adapter the engine refuses: the same one line, naming the adapter and the problem.
            log.critical("cannot load %s", error)
            raise SystemExit(EXIT_MODEL_UNUSABLE) from None
        runtime_module.install(self.runtime)

    def stop(self, parent: Any) -> None:
        if self.runtime is not None:
            self.runtime.stop()

    def info(self, parent: Any) -> dict[str, Any]:
        stats = self.runtime.loop.stats() if self.runtime is not None else None
        return readable_stats(stats, TOKENS_PER_SECOND_WINDOW_S)


@inspect_command()
def engine_stats(state: Any) -> dict[str, Any]:
    """`celery inspect engine_stats`: the engine's pages, jobs and throughput, as numbers."""
    return runtime_module.current(timeout=0).loop.stats()


_celery_revoke = Panel.data["revoke"]


@control_command(variadic="task_id", signature="[id1 [id2 [... [idN]]]]")
def revoke(state: Any, task_id: Any, terminate: bool = False, signal: str | None = None, **kwargs: Any
           ) -> dict[str, Any]:
    """Celery's revoke, which alone leaves a running task running (and, with terminate, fails on
    the threads pool, which cannot kill a thread): a genq job this worker has taken is cancelled
    as genq's own cancel does, within one engine step; the task then ends REVOKED
    (worker/tasks.py). Other tasks get Celery's revoke as it is."""
    task_ids = set(maybe_list(task_id) or [])
    try:
        runtime = runtime_module.current(timeout=0)
    except RuntimeError:
        return _celery_revoke(state, list(task_ids), terminate, signal, **kwargs)
    holders = runtime.loop.lease_holders()
    ours: dict[str, str] = {}
    for request in list(worker_state.requests.values()):
        if request.id in task_ids and request.task_name == TASK_NAME:
            identifier = identifier_of(request.id, request.kwargs)
            if holders.get(identifier) in (None, request.id):
                ours[request.id] = identifier
    if ours:
        # Flagged first, so that the task thread the cancel wakes knows it was revoked.
        _celery_revoke(state, list(ours), terminate=False)
        for identifier in ours.values():
            runtime.loop.cancel(identifier)
    others = task_ids - ours.keys()
    if not others:
        return ok(f"tasks {sorted(ours)} revoked: their generations are cancelled")
    return _celery_revoke(state, list(others), terminate, signal, **kwargs)


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
