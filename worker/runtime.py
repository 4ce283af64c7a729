"""The worker process's engine runtime: model, generator, engine loop,
publisher and control listener, built once by the EngineStep bootstep and
shared by every task thread."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import redis
from celery.backends.base import Backend

from engine import Generator
from engine.progress import LoadProgress
from producer.protocol import ControlMessage, cancel_key, control_channel
from worker.loop import EngineLoop
from worker.metrics import WorkerMetrics
from worker.model_card import CardPublisher, describe
from worker.publisher import Publisher
from worker.redelivery import LEASE_S, Redeliveries
from worker.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    generator: Generator
    publisher: Publisher
    loop: EngineLoop
    control: ControlListener
    redeliveries: Redeliveries
    card: CardPublisher

    @classmethod
    def start(cls, settings: Settings, backend: Backend, node: str) -> Runtime:
        """Load the model, start the engine loop and the control listener, then publish the
        model card under the worker's node name."""
        if not settings.model:
            raise ValueError("no model: pass --model DIR or set GENQ_MODEL")
        started = time.monotonic()
        log.info("loading model %s on %s", settings.model, settings.device)
        generator = Generator.from_pretrained(
            settings.model,
            device=settings.device,
            dtype=settings.dtype,
            cache_tokens=settings.cache_tokens,
            cache_dtype=settings.cache_dtype,
            quantize=settings.quantize,
            page_size=settings.page_size,
            progress=LoadProgress(logger=log),
            max_batch_size=settings.max_batch_size,
            max_chunk_size=settings.max_chunk_size,
            prefix_caching=settings.prefix_caching,
            use_ngram_draft=settings.ngram_draft,
            draft_model_path=settings.draft_model,
            num_draft_tokens=settings.num_draft_tokens,
            max_speculative_batch=settings.max_speculative_batch,
            max_pending=max(1024, 4 * settings.concurrency),
        )
        client = settings.redis()
        warn_without_persistence(client)
        publisher = Publisher(client, settings.key_prefix, settings.stream_maxlen, settings.stream_ttl_s,
                              final_ttl_s=settings.visibility_timeout_s + settings.stream_ttl_s)
        metrics = WorkerMetrics() if settings.metrics_port else None
        log.info("warmed up the engine in %.2f s", generator.warmup())
        loop = EngineLoop(generator, publisher, on_finished=metrics.observe if metrics else None)
        loop.start()
        if metrics is not None and settings.metrics_port:
            metrics.watch(loop.stats)
            metrics.serve(settings.metrics_port, settings.metrics_address)
            log.info("Prometheus metrics on http://%s:%d/metrics", settings.metrics_address, settings.metrics_port)
        redeliveries = Redeliveries(client, backend, settings.key_prefix)
        card = CardPublisher(client, settings.key_prefix, settings.queue, node, *describe(generator, settings.model))
        card.heartbeat()
        control = ControlListener(client, settings.key_prefix, loop, redeliveries, card)
        control.start()
        log.info("engine ready in %.1f s: %d cache pages of %d tokens", time.monotonic() - started,
                 generator.pool.num_pages, generator.page_size)
        return cls(settings, generator, publisher, loop, control, redeliveries, card)

    def stop(self) -> None:
        """Let in-flight jobs finish within the grace period (requeued after it), then stop."""
        self.card.withdraw()
        self.loop.stop(self.settings.shutdown_grace_s)
        self.control.stop()


def warn_without_persistence(client: redis.Redis) -> None:
    """Queued tasks, results and streams live in Redis: one without an
    append-only file or RDB snapshots loses all of them on a restart."""
    try:
        aof = client.config_get("appendonly").get("appendonly")
        save = client.config_get("save").get("save")
    except redis.ResponseError:
        log.info("cannot read the persistence settings of Redis (CONFIG disabled); check them yourself")
        return
    if aof != "yes" and not save:
        where = client.connection_pool.connection_kwargs
        log.warning("REDIS HAS NO PERSISTENCE (appendonly=no, save=''): Redis at %s:%s loses every queued task, "
                    "result and stream when it restarts. Run it with --appendonly yes (as docker-compose.yml does).",
                    where.get("host"), where.get("port"))


class ControlListener:
    """Subscribes to the control channel and forwards cancellations to the loop;
    between messages it also refreshes the running jobs' leases and the model card."""

    def __init__(self, client: redis.Redis, key_prefix: str, loop: EngineLoop, redeliveries: Redeliveries,
                 card: CardPublisher) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(control_channel(key_prefix))
        self.loop = loop
        self.redeliveries = redeliveries
        self.card = card
        self._leases_refreshed = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="genq-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pubsub.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if time.monotonic() - self._leases_refreshed >= LEASE_S / 3:
                self._leases_refreshed = time.monotonic()
                self.redeliveries.refresh_leases(self.loop.lease_holders())
                self.card.heartbeat()
            try:
                message = self.pubsub.get_message(timeout=1.0)
            except redis.RedisError:
                log.exception("control channel: lost Redis, retrying")
                self._stop.wait(1.0)
                continue
            if message is None:
                self._sweep_cancel_keys()
                continue
            try:
                command = ControlMessage.model_validate(json.loads(message["data"]))
            except ValueError:
                log.warning("control channel: ignoring malformed message %r", message["data"][:200])
                continue
            self.loop.cancel(command.cancel)

    def _sweep_cancel_keys(self) -> None:
        """Control messages are at-most-once (one published while the
        subscription reconnects is lost); the cancel keys are not, so running
        jobs' keys are checked whenever the channel is quiet for a second."""
        identifiers = self.loop.active_identifiers()
        if not identifiers:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for identifier in identifiers:
                pipe.exists(cancel_key(identifier, self.key_prefix))
            flags = pipe.execute()
        except redis.RedisError:
            log.warning("control channel: could not check cancel keys")
            return
        for identifier, cancelled in zip(identifiers, flags):
            if cancelled:
                self.loop.cancel(identifier)


_runtime: Runtime | None = None
_ready = threading.Event()


def install(runtime: Runtime) -> None:
    global _runtime
    _runtime = runtime
    _ready.set()


def current(timeout: float | None = None) -> Runtime:
    """The process's runtime; tasks that arrive while the model loads wait here."""
    if not _ready.wait(timeout) or _runtime is None:
        raise RuntimeError("the engine is not running in this worker process")
    return _runtime
