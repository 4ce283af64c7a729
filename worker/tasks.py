"""The `genq.generate` task: validate, submit to the engine loop, wait, return
the result. Many of these run at once (threads pool); none touches the
generator itself."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Ignore, Reject

from producer.protocol import IDENTIFIER_PATTERN, TASK_NAME, GenerationRequest, ProtocolError, StreamEvent
from worker import runtime as runtime_module
from worker.jobs import build_job
from worker.loop import ShuttingDown, Submission

IDENTIFIER_RE = re.compile(IDENTIFIER_PATTERN)
log = logging.getLogger(__name__)
ENGINE_READY_TIMEOUT_S = 600.0


class GenerationFailed(RuntimeError):
    """The request was refused or failed in the engine; the message says why."""


@shared_task(name=TASK_NAME, bind=True)
def generate(self: Task, **kwargs: Any) -> dict[str, Any]:
    runtime = runtime_module.current(timeout=ENGINE_READY_TIMEOUT_S)
    # An unusable identifier is reported on the task id's stream (the request still fails).
    requested = kwargs.get("identifier")
    identifier = requested if isinstance(requested, str) and IDENTIFIER_RE.fullmatch(requested) else self.request.id
    if runtime.loop.is_running(identifier, self.request.id):
        raise _duplicate(identifier)
    if identifier in runtime.loop.active_identifiers():
        raise GenerationFailed(f"identifier: {identifier!r} is already generating")
    attempt, cancel_requested = runtime.publisher.begin_attempt(identifier)
    try:
        request = GenerationRequest.parse_payload(kwargs)
        job = build_job(request, runtime.generator.tokenizer, identifier)
    except (ProtocolError, ValueError) as error:
        message = str(error)
        _publish_error(runtime, identifier, attempt, message)
        raise GenerationFailed(message) from None
    deadline = request.deadline
    if request.timeout_s is not None:
        deadline = time.time() + request.timeout_s
    submission = Submission(identifier, attempt, job, request, deadline, self.request.id, cancel_requested)
    try:
        runtime.loop.submit(submission)
    except ShuttingDown:
        raise Reject("worker shutting down", requeue=True) from None
    submission.done.wait()
    if submission.requeue:
        raise Reject("worker shut down before the job finished", requeue=True)
    if submission.duplicate:
        raise _duplicate(identifier)
    if submission.error is not None:
        raise GenerationFailed(submission.error)
    if submission.result is None:
        raise GenerationFailed("the engine loop finished the job without a result")
    return submission.result.to_dict()


def _duplicate(identifier: str) -> Ignore:
    """A redelivered message for a request this worker is still generating
    (it outlived the visibility timeout): acknowledge it and store nothing,
    so the running attempt's result stands."""
    log.warning("request %r redelivered while still generating here; ignoring the duplicate", identifier)
    return Ignore()


def _publish_error(runtime: runtime_module.Runtime, identifier: str, attempt: int, message: str) -> None:
    event = StreamEvent(id=identifier, seq=0, attempt=attempt, event="error", finish_reason="error", error=message)
    runtime.publisher.publish([event])
