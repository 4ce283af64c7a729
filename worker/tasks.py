"""The `genq.generate` task: decide what the delivery needs (worker/delivery.py),
then parse, build the engine job, submit it to the engine loop and wait for
the result. Many of these run at once (threads pool); none touches the
generator itself.

What a Celery user sees (docs/protocol.md, "Using genq from Celery"): an
invalid request fails with ProtocolError, a job the engine fails with
GenerationFailed, a revoked one ends REVOKED; as a chain child the task joins
its parent's result to its request as `chain_as` says."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Task, shared_task, signals
from celery.exceptions import Ignore, Reject
from celery.worker import state as worker_state

from engine import JobRejected
from engine.admission import admit
from producer.protocol import TASK_NAME, GenerationRequest, ProtocolError, StreamEvent, chained_payload
from worker import delivery
from worker import runtime as runtime_module
from worker.images import decode_images, prepare_images
from worker.jobs import build_job
from worker.loop import ShuttingDown, Submission
from worker.publisher import Publisher

log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    """A valid request that the engine could not run or finish (full queue, a numeric failure, its
    identifier already generating); the message says why. Invalid requests raise ProtocolError."""


# track_started is off because Celery would store STARTED under the task id before the task
# body could check that id; decide() stores it itself once the id is known to be a safe key.
@shared_task(name=TASK_NAME, bind=True, track_started=False)
def generate(self: Task, *parents: Any, **kwargs: Any) -> dict[str, Any]:
    """`parents` holds the parent's result when Celery runs this task as a chain or chord child."""
    decision = delivery.decide(self, kwargs)
    if isinstance(decision, delivery.Ignore):
        if decision.report_to is not None:
            runtime = runtime_module.current(timeout=delivery.ENGINE_READY_TIMEOUT_S)
            publish_error(runtime.publisher, decision.report_to, decision.reason)
        raise Ignore(decision.reason)
    if isinstance(decision, delivery.Defer):
        queue = (self.request.delivery_info or {}).get("routing_key")
        self.apply_async(args=self.request.args, kwargs=self.request.kwargs, task_id=self.request.id,
                         countdown=delivery.LEASE_S, queue=queue)
        raise Ignore()
    if isinstance(decision, delivery.Answer):
        if decision.error is not None:
            raise GenerationFailed(decision.error)
        assert decision.result is not None
        return decision.result
    runtime = runtime_module.current(timeout=delivery.ENGINE_READY_TIMEOUT_S)
    try:
        return _run(self, runtime, decision, parents, kwargs)
    finally:
        runtime.redeliveries.release_lease(decision.identifier, self.request.id)


def _run(self: Task, runtime: runtime_module.Runtime, decision: delivery.Run, parents: tuple[Any, ...],
         kwargs: dict[str, Any]) -> dict[str, Any]:
    """Parse, build the job, submit it, wait: the delivery is this task's to run (decide() began its attempt)."""
    identifier, attempt, cancel_requested = decision.identifier, decision.attempt, decision.cancel_requested
    try:
        request = GenerationRequest.parse_payload(chained_payload(kwargs, parents))
        images = decode_images(request, runtime.card.card.images)
        generator = runtime.generator
        embeddings = prepare_images(images, generator) if images else []
        vision = generator.vision
        job = build_job(request, generator.tokenizer, identifier, generator.model.config.vocab_size, embeddings,
                        vision.image_prompt(generator.tokenizer) if vision is not None else None)
        # The engine's own refusals (context, vocabulary) checked here too, so that they fail as the
        # invalid requests they are rather than as GenerationFailed from the loop.
        admit(job, generator.limits)
    except (ProtocolError, JobRejected, ValueError) as error:
        message = str(error)
        publish_error(runtime.publisher, identifier, message, attempt)
        raise ProtocolError(message) from None
    except Exception as error:
        # Anything else (a chat template that fails on this chat, say) still ends the request's
        # stream, so that no reader waits for an event that never comes.
        log.exception("request %r: building its job failed", identifier)
        message = f"the worker could not build the job: {type(error).__name__}: {error}"
        publish_error(runtime.publisher, identifier, message, attempt)
        raise GenerationFailed(message) from None
    deadline = request.deadline if request.timeout_s is None else time.time() + request.timeout_s
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
        log.warning("request %r redelivered while still generating here; ignoring the duplicate", identifier)
        raise Ignore()
    if submission.error is not None:
        raise GenerationFailed(submission.error)
    if submission.result is None:
        raise GenerationFailed("the engine loop finished the job without a result")
    if submission.result.finish_reason == "cancelled" and self.request.id in worker_state.revoked:
        _end_revoked(self)
    return submission.result.to_dict()


def _end_revoked(task: Task) -> None:
    """A revoke cancelled the job (worker/bootsteps.py routes it to the engine loop, whose
    `cancelled` event is out): end the task as Celery ends a revoked one (REVOKED stored, the
    task-revoked event for Flower, the task_revoked signal), not as a SUCCESS."""
    task.send_event("task-revoked", terminated=False, signum=None, expired=False)
    task.backend.mark_as_revoked(task.request.id, "revoked", request=task.request)
    signals.task_revoked.send(sender=task, request=task.request, terminated=False, signum=None, expired=False)
    raise Ignore("revoked")


def publish_error(publisher: Publisher, identifier: str, message: str, attempt: int | None = None) -> None:
    """A request's only event, `error`: in a new attempt unless the task has begun one."""
    if attempt is None:
        attempt, _ = publisher.begin_attempt(identifier)
    event = StreamEvent(id=identifier, seq=0, attempt=attempt, event="error", finish_reason="error", error=message)
    publisher.publish([event])
