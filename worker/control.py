"""The control channel listener: cancellations from producers reach the engine
loop through it, and so do LoRA adapter loads and unloads addressed to this
worker's queue; between messages it keeps the running jobs' leases and the
model card fresh."""

from __future__ import annotations

import json
import logging
import threading
import time

import redis

from producer.protocol import ControlMessage, cancel_key, control_channel
from worker.loop import AdapterChange, EngineLoop
from worker.model_card import CardPublisher
from worker.redelivery import LEASE_S, Redeliveries

log = logging.getLogger(__name__)


class ControlListener:
    """Subscribes to the control channel and forwards cancellations to the loop;
    between messages it also refreshes the running jobs' leases and the model card."""

    def __init__(self, client: redis.Redis, key_prefix: str, queue: str, loop: EngineLoop,
                 redeliveries: Redeliveries, card: CardPublisher) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.queue = queue
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
            self._apply(command)

    def _apply(self, command: ControlMessage) -> None:
        """Forward a cancel to the loop; an adapter load or unload too when it names this worker's queue."""
        if command.cancel is not None:
            self.loop.cancel(command.cancel)
        elif command.load_adapter is not None and command.load_adapter.queue == self.queue:
            self.loop.change_adapter(AdapterChange(command.load_adapter.name, command.load_adapter.path))
        elif command.unload_adapter is not None and command.unload_adapter.queue == self.queue:
            self.loop.change_adapter(AdapterChange(command.unload_adapter.name))

    def _sweep_cancel_keys(self) -> None:
        """Control messages are at-most-once (one published while the
        subscription reconnects is lost); the cancel keys are not, so running
        jobs' keys are checked whenever the channel is quiet for a second: one
        EXISTS over them all (nearly always 0), and only when some exist, which."""
        identifiers = self.loop.active_identifiers()
        if not identifiers:
            return
        keys = [cancel_key(identifier, self.key_prefix) for identifier in identifiers]
        try:
            if not self.client.exists(*keys):
                return
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            flags = pipe.execute()
        except redis.RedisError:
            log.warning("control channel: could not check cancel keys")
            return
        for identifier, cancelled in zip(identifiers, flags):
            if cancelled:
                self.loop.cancel(identifier)
