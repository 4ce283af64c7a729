"""The `genq.generate` task: validate, submit to the engine loop, wait, return
the result. Many of these run at once (threads pool); none touches the
generator itself."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from celery import Task, shared_task, states
from celery.exceptions import Ignore, Reject

from producer.protocol import (
    IDENTIFIER_PATTERN,
    TASK_NAME,
    GenerationRequest,
    ProtocolError,
    StreamEvent,
    validate_task_id,
)
from worker import runtime as runtime_module
from worker.jobs import build_job
from worker.loop import ShuttingDown, Submission
from worker.redelivery import LEASE_S, with_redis_retries

IDENTIFIER_RE = re.compile(IDENTIFIER_PATTERN)
log = logging.getLogger(__name__)
ENGINE_READY_TIMEOUT_S = 600.0


class GenerationFailed(RuntimeError):
    """The request was refused or failed in the engine; the message says why."""


# track_started is off because Celery would store STARTED under the task id before the task
# body could check that id; the body stores it itself once the id is known to be a safe key.
@shared_task(name=TASK_NAME, bind=True, track_started=False)
def generate(self: Task, **kwargs: Any) -> dict[str, Any]:
    requested = kwargs.get("identifier")
    usable = requested if isinstance(requested, str) and IDENTIFIER_RE.fullmatch(requested) else None
    try:
        validate_task_id(self.request.id)
    except ProtocolError as error:
        raise _refuse_task_id(usable, str(error)) from None
    self.update_state(state=states.STARTED, meta={"pid": os.getpid(), "hostname": self.request.hostname})
    runtime = runtime_module.current(timeout=ENGINE_READY_TIMEOUT_S)
    # An unusable identifier is reported on the task id's stream (the request still fails).
    identifier = usable or self.request.id
    if runtime.loop.is_running(identifier, self.request.id):
        raise _duplicate(identifier)
    if runtime.redeliveries.finished(self.request.id):
        log.warning("task %s delivered again after its result was stored; not running it again", self.request.id)
        raise Ignore()
    published = with_redis_retries(lambda: runtime.publisher.final_result(self.request.id), "final result")
    if published is not None:
        log.warning("task %s delivered again after its final event; answering with that result", self.request.id)
        return published
    holder = runtime.redeliveries.take_lease(identifier, self.request.id)
    if holder == self.request.id:
        raise _defer(self, identifier)
    if holder is not None or identifier in runtime.loop.active_identifiers():
        raise GenerationFailed(f"identifier: {identifier!r} is already generating")
    try:
        return _run(self, runtime, identifier, kwargs)
    finally:
        runtime.redeliveries.release_lease(identifier, self.request.id)


def _run(self: Task, runtime: runtime_module.Runtime, identifier: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    attempt, cancel_requested = with_redis_retries(lambda: runtime.publisher.begin_attempt(identifier), "attempt")
    try:
        request = GenerationRequest.parse_payload(kwargs)
        generator = runtime.generator
        vocab_size = generator.model.config.vocab_size
        job = build_job(request, generator.tokenizer, identifier, vocab_size, generator.max_seq_len)
    except (ProtocolError, ValueError) as error:
        message = str(error)
        _publish_error(runtime, identifier, attempt, message)
        raise GenerationFailed(message) from None
    deadline = request.deadline
    if request.timeout_s is not None:
        deadline = time.time() + request.timeout_s
    jobs = job.samples(request.n) if request.n > 1 else [job]
    submission = Submission(identifier, attempt, jobs, request, deadline, self.request.id, cancel_requested)
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


def _defer(task: Task, identifier: str) -> Ignore:
    """Another worker holds this very task's lease (it is generating it): send a
    copy that checks again once the lease could have lapsed, and drop this one."""
    log.warning("task %s delivered again while another worker runs it; checking again in %d s", task.request.id,
                LEASE_S)
    queue = (task.request.delivery_info or {}).get("routing_key")
    task.apply_async(kwargs=task.request.kwargs, task_id=task.request.id, countdown=LEASE_S, queue=queue)
    return Ignore()


def _duplicate(identifier: str) -> Ignore:
    """A redelivered message for a request this worker is still generating
    (it outlived the visibility timeout): acknowledge it and store nothing,
    so the running attempt's result stands."""
    log.warning("request %r redelivered while still generating here; ignoring the duplicate", identifier)
    return Ignore()


def _refuse_task_id(identifier: str | None, message: str) -> Ignore:
    """A task id that must not become a Redis key: the message is acknowledged and dropped with no
    result stored (Ignore: Celery stores a FAILURE for a Reject, under that very key), and a valid
    identifier's stream gets the error."""
    log.error("refused a %s task: %s", TASK_NAME, message)
    if identifier is not None:
        runtime = runtime_module.current(timeout=ENGINE_READY_TIMEOUT_S)
        attempt, _ = runtime.publisher.begin_attempt(identifier)
        _publish_error(runtime, identifier, attempt, message)
    return Ignore(message)


def _publish_error(runtime: runtime_module.Runtime, identifier: str, attempt: int, message: str) -> None:
    event = StreamEvent(id=identifier, seq=0, attempt=attempt, event="error", finish_reason="error", error=message)
    runtime.publisher.publish([event])
