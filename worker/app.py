"""The Celery application, configured from Settings.

`celery -A worker.app ...` (worker, flower, inspect) finds `app` here.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from celery import Celery
from kombu.serialization import register
from kombu.utils.json import loads as json_loads

from producer.routing import task_router
from producer.settings import celery_base_config
from worker import bootsteps
from worker.broker import SCHEMES, TRANSPORT
from worker.lane_cycle import LANE_POLL_S, lane_cycle
from worker.pacing import paced_result_json
from worker.results import RESULT_BACKEND
from worker.settings import Settings

PACED_JSON = "genq-paced-json"
"""The results' serializer: kombu's JSON made in paced slices (worker/pacing.py). It writes the
same text as "json" under the same content type, so any client decodes it as JSON; registered
under that content type, it also decodes what this worker reads back."""


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings()
    backend = settings.backend
    if urlsplit(backend).scheme in SCHEMES:
        # Celery's Redis backend, two commands fewer per stored state (worker/results.py); Sentinel keeps Celery's.
        backend = f"{RESULT_BACKEND}+{backend}"
    app = Celery("genq", broker=settings.broker, backend=backend, include=["worker.tasks"])
    config = celery_base_config(settings)
    # Sweep for abandoned (killed-worker) tasks often enough to honour a short visibility timeout;
    # it must exceed the longest generation, since acks_late keeps a running task unacknowledged.
    config["broker_transport_options"].update(
        unacked_restore_interval=max(1, min(10, settings.visibility_timeout_s // 2)), unacked_restore_throttle=1
    )
    if settings.tenant_lanes:
        # Take from the queue and its tenant lanes in turn, none holding the reserved task slots
        # (worker/lane_cycle.py, docs/protocol.md Fair share).
        config["broker_transport_options"].update(
            queue_order_strategy=lane_cycle(settings.concurrency, settings.lane_reserve), polling_interval=LANE_POLL_S
        )
    if urlsplit(settings.broker.split(";")[0]).scheme in SCHEMES:
        # kombu's Redis transport, sharing one client per channel (worker/broker.py); a Sentinel keeps kombu's own.
        config["broker_transport"] = TRANSPORT
    register(PACED_JSON, paced_result_json, json_loads, content_type="application/json", content_encoding="utf-8")
    app.conf.update(
        config,
        result_serializer=PACED_JSON,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        result_expires=settings.result_expires_s,
        # genq.generate (a chain's next genq task) to its queue; other tasks a chain or callback sends
        # from here (the user's) to their own routes or Celery's default queue, never to genq's.
        task_routes=(task_router(settings.queue_for),),
        worker_pool="threads",
        worker_concurrency=settings.concurrency,
        worker_hijack_root_logger=False,
        worker_consumer="worker.consumer:GuardedConsumer",
        # Storing a result waits out a Redis restart (about 3 minutes at most) instead of failing the task.
        result_backend_always_retry=True,
        result_backend_max_retries=20,
    )
    app.genq_settings = settings
    bootsteps.install(app)
    return app


app = create_app()
