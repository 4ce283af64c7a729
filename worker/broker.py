"""kombu's Redis transport with one client per channel for its one-off commands, and its
unacknowledged-message index written without MULTI/EXEC (issue 30).

kombu's Redis channel builds a new `redis.Redis` (a pool's client: no new connection, but
about a hundred microseconds of Python setting up its response callbacks) for every command it
sends outside its polling client: each acknowledgement, each received task's unacked-index
write, each batch of task events. At a few hundred requests a second that was about a twelfth
of the worker's Python time (bench/worker_intake.py). A client on the channel's own connection
pool is safe to share between threads (each command takes a pooled connection), so this channel
keeps one, made again when kombu replaces the pool (after a fork or a lost connection).

kombu records each received message in two keys (the index ZADD, the message HSET) and drops it
from both on its acknowledgement, each pair inside MULTI/EXEC: four of a request's commands. The
pairs go out as plain pipelines. Atomicity guarded nothing: the only reader, the restore of
messages unacknowledged past the visibility timeout, takes index entries that old, long after
their message was written, and restores each in its own WATCHed transaction that skips one whose
message is already gone (kombu's QoS.restore_by_tag)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

TRANSPORT = "worker.broker:Transport"
"""Celery's broker_transport for a redis:// or rediss:// broker (worker/app.py)."""
SCHEMES = ("redis", "rediss")


class QoS(kombu_redis.QoS):
    @contextmanager
    def pipe_or_acquire(self, pipe: Any = None, client: redis.Redis | None = None) -> Iterator[Any]:
        if pipe:
            yield pipe
            return
        with self.channel.conn_or_acquire(client) as acquired:
            yield acquired.pipeline(transaction=False)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _shared: redis.Redis | None = None

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[Any]:
        if client:
            yield client
            return
        shared = self._shared
        if shared is None or shared.connection_pool is not self.pool:
            shared = self._shared = self._create_client()
        yield shared


class Transport(kombu_redis.Transport):
    Channel = Channel
