"""What to do with one delivery of a `genq.generate` task, decided in one place.

A task message can arrive with a task id that must not name a Redis key, twice
(kombu redelivers unacknowledged messages; producers' watchdogs resend), after
its result or final event was stored, or while this or another worker runs it
(worker/redelivery.py explains the leases). decide() weighs all of that
before any work and says: run it, ignore it, defer it, or answer it at once.
Messages Celery cannot even build a request from are refused earlier, in the
consumer (worker/intake.py); a request cancelled before it starts is the
engine loop's to answer (it also sees cancels that overtake their request).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from celery import Task, states

from producer.protocol import IDENTIFIER_RE, TASK_NAME, ProtocolError, validate_task_id
from worker import runtime as runtime_module
from worker.redelivery import LEASE_S, finished

ENGINE_READY_TIMEOUT_S = 600.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """Generate it: this task now holds the identifier's lease and has begun the request's `attempt`."""

    identifier: str
    attempt: int
    cancel_requested: bool


@dataclass(frozen=True)
class Ignore:
    """Acknowledge and store nothing; `report_to` names a stream that gets `reason` as an error event."""

    reason: str
    report_to: str | None = None


@dataclass(frozen=True)
class Defer:
    """Another worker holds this very task's lease: re-send a copy that checks again once the lease could
    have lapsed, and drop this one."""


@dataclass(frozen=True)
class Answer:
    """Answer without generating: with the result already published, or fail with `error`."""

    result: dict[str, Any] | None = None
    error: str | None = None


Decision = Run | Ignore | Defer | Answer


def identifier_of(task_id: str, kwargs: Any) -> str:
    """The stream a delivery reports on: its `identifier` when usable, else the task id."""
    requested = kwargs.get("identifier") if isinstance(kwargs, dict) else None
    return requested if isinstance(requested, str) and IDENTIFIER_RE.fullmatch(requested) else task_id


def decide(task: Task, kwargs: dict[str, Any]) -> Decision:
    """The delivery's fate. Takes the identifier's lease when the answer is Run; stores the
    STARTED state once the task id is known to be a safe key (track_started is off for that)."""
    task_id = task.request.id
    # An unusable identifier is reported on the task id's stream (the request still fails).
    identifier = identifier_of(task_id, kwargs)
    try:
        validate_task_id(task_id)
    except ProtocolError as error:
        # An id that must not become a Redis key: no result is stored (Celery would store a Reject's
        # FAILURE under that very key); a valid identifier's stream gets the error.
        log.error("refused a %s task: %s", TASK_NAME, error)
        return Ignore(str(error), report_to=identifier if identifier != task_id else None)
    # Looked up before STARTED is stored over it: Celery keeps a stored SUCCESS from being
    # overwritten, not a FAILURE, so a failed task delivered again (its acknowledgement lost to
    # a Redis restart) would look unfinished and run again, with a second final event.
    if finished(task.backend, task_id):
        log.warning("task %s delivered again after its result was stored; not running it again", task_id)
        return Ignore("already finished")
    task.update_state(state=states.STARTED, meta={"pid": os.getpid(), "hostname": task.request.hostname})
    runtime = runtime_module.current(timeout=ENGINE_READY_TIMEOUT_S)
    if runtime.loop.is_running(identifier, task_id):
        # Redelivered while still generating here (it outlived the visibility timeout): the
        # running attempt's result stands.
        log.warning("request %r redelivered while still generating here; ignoring the duplicate", identifier)
        return Ignore("duplicate of a running task")
    claim = runtime.redeliveries.claim(identifier, task_id,
                                       lambda: identifier in runtime.loop.active_identifiers())
    if claim.final is not None:
        log.warning("task %s delivered again after its final event; answering with that result", task_id)
        return Answer(result=claim.final)
    if claim.holder == task_id:
        log.warning("task %s delivered again while another worker runs it; checking again in %d s", task_id,
                    LEASE_S)
        return Defer()
    if claim.holder is not None or claim.active:
        return Answer(error=f"identifier: {identifier!r} is already generating")
    return Run(identifier, claim.attempt, claim.cancel_requested)
