"""The worker process's engine runtime: model, generator, engine loop,
publisher and control listener (worker/control.py), built once by the
EngineStep bootstep and shared by every task thread."""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis
from celery import Task
from celery.signals import task_success

from engine import Generator
from engine.errors import AdapterLoadError
from engine.heap import settle_startup_heap
from engine.progress import LoadProgress
from engine.synthetic import SyntheticGenerator
from producer.protocol import TASK_NAME
from producer.tenants.ranking import top_tenants
from worker.coalescing import Coalescing
from worker.control import ControlListener
from worker.loop import EngineLoop
from worker.metrics import WorkerMetrics
from worker.model_card import CardPublisher, describe
from worker.publisher import Publisher
from worker.redelivery import Redeliveries
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
    def start(cls, settings: Settings, node: str) -> Runtime:
        """Load the model, start the engine loop and the control listener, then publish the
        model card under the worker's node name."""
        if not settings.model:
            raise ValueError("no model: pass --model DIR or set GENQ_MODEL")
        started = time.monotonic()
        log.info("loading model %s on %s", settings.model, settings.device)
        generator = load_generator(settings, settings.model)
        load_adapters(generator, settings)
        client = settings.redis()
        warn_without_persistence(client)
        metrics = None
        if settings.metrics_port:
            # The tenants with the most tokens over the last day get the metrics' tenant labels first.
            metrics = WorkerMetrics(settings.metrics_tenants,
                                    top_tenants(client, settings.key_prefix, settings.metrics_tenants, hours=24))
        publisher = Publisher(client, settings.key_prefix, settings.stream_maxlen, settings.stream_ttl_s,
                              final_ttl_s=settings.visibility_timeout_s + settings.stream_ttl_s,
                              usage_retention_s=settings.usage_retention_s,
                              on_usage=metrics.count_usage if metrics else None)
        task_success.connect(partial(forget_final_record, publisher), weak=False)
        log.info("warmed up the engine in %.2f s", generator.warmup())
        # What is alive now (model, Celery, imports) lives as long as the process: the collector's
        # passes, which stop every thread (the engine loop too), need not walk it again.
        settle_startup_heap()
        # How long another thread may keep the GIL once the loop's forward is over (bench/celery_gil.py).
        sys.setswitchinterval(settings.switch_interval_ms / 1000)
        loop = EngineLoop(generator, publisher, on_finished=metrics.observe if metrics else None,
                          coalescing=Coalescing.of(settings.stream_coalesce_ms, settings.stream_coalesce_tokens))
        loop.start()
        if metrics is not None and settings.metrics_port:
            metrics.watch(loop.stats)
            metrics.serve(settings.metrics_port, settings.metrics_address)
            log.info("Prometheus metrics on http://%s:%d/metrics", settings.metrics_address, settings.metrics_port)
        redeliveries = Redeliveries(client, settings.key_prefix, settings.stream_ttl_s)
        card = CardPublisher(client, settings.key_prefix, settings.queue, node,
                             *describe(generator, card_model(settings.model, settings.synthetic_rate)))
        card.heartbeat()
        loop.on_adapters = card.set_adapters  # before the control listener can change any
        control = ControlListener(client, settings.key_prefix, settings.queue, loop, redeliveries, card)
        control.start()
        log.info("engine ready in %.1f s: %d cache pages of %d tokens", time.monotonic() - started,
                 generator.pool.num_pages, generator.page_size)
        return cls(settings, generator, publisher, loop, control, redeliveries, card)

    def stop(self) -> None:
        """Let in-flight jobs finish within the grace period (requeued after it), then stop."""
        self.card.withdraw()
        self.loop.stop(self.settings.shutdown_grace_s)
        self.control.stop()


def load_generator(settings: Settings, model: str) -> Generator:
    """The model's generator, or with --synthetic-rate the synthetic engine (a benchmark tool)."""
    if settings.synthetic_rate is not None:
        log.warning("SYNTHETIC ENGINE (--synthetic-rate %g): no model runs; requests get word tokens at %g "
                    "tokens/s. A benchmark and test tool, never for serving.", settings.synthetic_rate,
                    settings.synthetic_rate)
        return SyntheticGenerator.from_model_dir(model, settings.synthetic_rate, settings.engine_config(),
                                                 step_s=settings.synthetic_step_ms / 1000)
    return Generator.from_pretrained(
        model,
        device=settings.device,
        dtype=settings.dtype,
        config=settings.engine_config(),
        progress=LoadProgress(logger=log),
        draft_model_path=settings.draft_model,
        mmproj=settings.mmproj,
    )


def card_model(model: str, synthetic_rate: float | None) -> str:
    """The model the card names: a synthetic engine says so (GET /v1/models shows it)."""
    return model if synthetic_rate is None else f"{model} (synthetic engine, {synthetic_rate:g} tokens/s)"


def load_adapters(generator: Generator, settings: Settings) -> None:
    """Register the --lora adapters, at most max_loras of them resident on the device; the first one
    refused raises AdapterLoadError naming it (the worker stops: worker/bootsteps.py)."""
    generator.adapters.max_loras = settings.max_loras
    for name, path in settings.lora_adapters.items():
        try:
            generator.adapters.register(name, path)
        except AdapterLoadError as error:
            raise AdapterLoadError(f"LoRA adapter {name!r}: {error}") from None
        log.info("loaded LoRA adapter %r from %s", name, path)


def forget_final_record(publisher: Publisher, sender: Task, **_: Any) -> None:
    """Celery sends task_success after its result backend stored the result: the task's final
    record, which covered the moment before, would only be a second copy of it."""
    if sender.name == TASK_NAME:
        publisher.forget_final(sender.request.id)


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
