"""Completion callbacks: POST a request's outcome, signed, to the URL its sender gave.

Who sends them: the gateway enqueues ``genq.generate`` with
``link=deliver_callback.s(event="generation.succeeded", ...)`` and
``link_error=deliver_callback.s(event="generation.failed", ...)``, both routed to
GENQ_CALLBACK_QUEUE. When the generation ends, the GPU worker that ran it only
*publishes* those signatures as new task messages (celery/app/trace.py,
``_dispatch_callbacks_and_chain``: ``signature(callbacks[0]).apply_async((retval,))``;
celery/backends/base.py, ``_call_task_errbacks``: an errback that the GPU worker
does not have registered, or whose task takes one argument, is sent with
``group(...).apply_async((task_id,))`` after the failure is stored). The HTTP
request, its retries and its backoff run here, on a CPU worker:

    genq callback-worker          # or: celery -A producer.callbacks worker -Q genq-callbacks -P threads

The body is JSON, ``{"id", "event", "state", "result", "error"}``: on success the
task's GenerationResult (cancelled requests included, finish_reason "cancelled"),
on failure the worker's error message. The end of a batch (the gateway's batch driver sends it,
producer/gateway/batch_runner.py) is ``{"id", "event": "batch.<status>", "batch": <Batch object>}``.
Network errors, 408, 429 and 5xx answers
are retried with exponential backoff and jitter; any other 4xx is final (the
receiver refused the payload, sending it again would not help). Each try is
signed anew (timestamp = send time) and carries the same `X-Genq-Delivery` id,
so a receiver can drop duplicates.

Before each try the URL is checked again (producer.callback_targets: http(s) only, and by
default public addresses only) and the request goes to the address that was checked, so a
name that re-resolves to an internal address after the gateway accepted it is refused here.
A refused URL is final; a name that does not resolve is retried like a network error.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import httpx
from celery import Celery, Task
from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from producer.callback_targets import CallbackTarget, CallbackUrlRefused, resolve_target
from producer.protocol import GenerationResult
from producer.settings import ClientSettings, celery_base_config
from producer.signing import signed_headers

log = logging.getLogger(__name__)

DELIVER_CALLBACK_TASK = "genq.deliver_callback"
DEFAULT_CALLBACK_QUEUE = "genq-callbacks"
EVENT_HEADER = "X-Genq-Event"
DELIVERY_HEADER = "X-Genq-Delivery"
RETRYABLE_STATUSES = frozenset({408, 425, 429})

CallbackEvent = Literal["generation.succeeded", "generation.failed", "batch.completed", "batch.expired",
                        "batch.cancelled"]


class CallbackSettings(ClientSettings):
    """The shared GENQ_* names (ClientSettings), with `queue` the callback queue, and GENQ_CALLBACK_* knobs."""

    model_config = SettingsConfigDict(env_prefix="GENQ_CALLBACK_", extra="ignore", populate_by_name=True)

    webhook_secret: SecretStr | None = Field(default=None, validation_alias="GENQ_WEBHOOK_SECRET",
                                             description="signs every callback")
    queue: str = Field(default=DEFAULT_CALLBACK_QUEUE, min_length=1, validation_alias="GENQ_CALLBACK_QUEUE",
                       description="queue of genq.deliver_callback")
    max_retries: int = Field(default=5, ge=0, description="retries after the first try")
    backoff_s: int = Field(default=2, ge=1, description="first retry delay; doubled each retry (with full jitter)")
    backoff_max_s: int = Field(default=300, ge=1, description="ceiling of the retry delay")
    timeout_s: float = Field(default=10.0, gt=0, description="per-try HTTP timeout")
    concurrency: int = Field(default=8, ge=1, description="callbacks in flight on one callback worker")
    allow_private_hosts: bool = Field(default=False, description="also call back loopback, private, link-local, ... "
                                                                 "addresses (trusted deployments only)")


class CallbackRetryable(RuntimeError):
    """The receiver could not take the callback now (5xx, 408, 425, 429): try again later."""


class CallbackRejected(RuntimeError):
    """The receiver refused the callback for good (a 4xx other than 408, 425, 429)."""


def create_app(settings: CallbackSettings | None = None) -> Celery:
    settings = settings or CallbackSettings()
    app = Celery("genq-callbacks", broker=settings.broker, backend=settings.backend)
    app.conf.update(
        celery_base_config(settings),
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,  # deliveries and their retries show in Flower
        task_default_queue=settings.queue,
        task_routes={DELIVER_CALLBACK_TASK: {"queue": settings.queue}},
        worker_pool="threads",
        worker_concurrency=settings.concurrency,
        worker_hijack_root_logger=False,
    )
    app.genq_callback_settings = settings

    # ignore_result: the HTTP status is in the task's events (Flower); the backend need not keep it.
    # shared=False: the task closes over these settings, so it must not be lent to other apps.
    @app.task(name=DELIVER_CALLBACK_TASK, bind=True, ignore_result=True, shared=False,
              autoretry_for=(httpx.TransportError, CallbackRetryable), max_retries=settings.max_retries,
              retry_backoff=settings.backoff_s, retry_backoff_max=settings.backoff_max_s, retry_jitter=True)
    def deliver_callback(self: Task, outcome: dict[str, Any] | str, *, callback_url: str, identifier: str,
                         event: CallbackEvent) -> int:
        """POST the outcome of `identifier` to `callback_url`. `outcome` is what Celery passes a
        link: the result dict on success, the failed task's id on failure. Returns the HTTP status."""
        if settings.webhook_secret is None:
            raise CallbackRejected("GENQ_WEBHOOK_SECRET is not set on the callback worker: callbacks are signed")
        target = _checked_target(callback_url, settings.allow_private_hosts)
        body = json.dumps(_payload(app, outcome, identifier, event), separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "genq-callback/1",
            EVENT_HEADER: event,
            DELIVERY_HEADER: self.request.id,
            **signed_headers(settings.webhook_secret.get_secret_value(), body),  # signed now, at each try
        }
        response = post(target, body, headers, settings.timeout_s)
        status = response.status_code
        if status >= 500 or status in RETRYABLE_STATUSES:
            log.warning("callback %s for %s: HTTP %d on try %d of %d", self.request.id, identifier, status,
                        self.request.retries + 1, settings.max_retries + 1)
            raise CallbackRetryable(f"{callback_url} answered HTTP {status}")
        if status >= 400:
            raise CallbackRejected(f"{callback_url} refused the callback: HTTP {status}")
        return status

    return app


def _checked_target(callback_url: str, allow_private: bool) -> CallbackTarget:
    try:
        return resolve_target(callback_url, allow_private=allow_private)
    except CallbackUrlRefused as error:
        if error.retryable:
            raise CallbackRetryable(f"{callback_url}: {error}") from None
        log.error("callback to %s refused: %s", callback_url, error)
        raise CallbackRejected(f"{callback_url}: {error}") from None


def post(target: CallbackTarget, body: bytes, headers: dict[str, str], timeout_s: float) -> httpx.Response:
    """POST to the checked address, under the URL's own name (Host header, TLS SNI and
    certificate check); redirects are not followed, since they would skip the check."""
    extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
    with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
        return client.post(target.connect_url, content=body, headers={**headers, "Host": target.host_header},
                           extensions=extensions)


def _payload(app: Celery, outcome: dict[str, Any] | str, identifier: str, event: CallbackEvent) -> dict[str, Any]:
    if event.startswith("batch."):
        assert isinstance(outcome, dict), "a batch's end is sent with its Batch object"
        return {"id": identifier, "event": event, "batch": outcome}
    if event == "generation.succeeded":
        assert isinstance(outcome, dict), "a link receives the result dict on success"
        result = GenerationResult.from_dict(outcome)
        return {"id": identifier, "event": event, "state": "SUCCESS", "result": result.to_dict(), "error": None}
    # An errback receives the failed task's id; its error is already in the result backend.
    failed = app.AsyncResult(str(outcome))
    return {"id": identifier, "event": event, "state": failed.state, "result": None, "error": str(failed.result)}


NODE_NAME = "genq-callbacks@%h"
"""Not Celery's default celery@%h, which the GPU worker on the same host already uses."""


def main(argv: list[str] | None = None) -> None:
    """`genq callback-worker`: a Celery threads-pool worker on the callback queue."""
    settings = app.genq_callback_settings
    app.worker_main(["worker", "--pool=threads", f"--concurrency={settings.concurrency}",
                     f"--queues={settings.queue}", f"--hostname={NODE_NAME}", *(argv or [])])


app = create_app()
