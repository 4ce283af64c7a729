"""The worker's kombu transport (worker/broker.py) on the test Redis: one client per channel for
its one-off commands instead of a new one each (issue 30: the worker's CPU per request), made
again when kombu replaces the channel's pool, its unacknowledged-message index kept without
MULTI/EXEC and still restored, and chosen for redis:// brokers only."""

from __future__ import annotations

import redis
from kombu import Connection

from worker.app import create_app
from worker.broker import Channel, Transport
from worker.settings import Settings


def test_a_channel_shares_one_client_until_its_pool_is_replaced(redis_url: str):
    with Connection(redis_url, transport=Transport) as connection:
        channel = connection.channel()
        assert isinstance(channel, Channel)
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second and first.ping()
        channel._disconnect_pools()  # what kombu does after a fork
        with channel.conn_or_acquire() as third:
            assert third is not first and third.connection_pool is channel.pool and third.ping()
        with channel.conn_or_acquire(first) as given:
            assert given is first
        channel.close()


def test_messages_go_through_the_shared_client(redis_url: str):
    with Connection(redis_url, transport=Transport) as connection:
        queue = connection.SimpleQueue("genq-broker-transport-test")
        queue.put({"n": 1})
        message = queue.get(timeout=10)
        assert message.payload == {"n": 1}
        message.ack()
        queue.close()


def test_the_worker_uses_it_for_redis_urls_only():
    assert create_app(Settings(redis_url="redis://localhost:6379/0")).conf.broker_transport == "worker.broker:Transport"
    sentinel = Settings(redis_url="sentinel://localhost:26379", sentinel_master="genq")
    assert create_app(sentinel).conf.broker_transport is None


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_the_unacked_index_is_written_and_dropped_without_multi(redis_url: str, redis_client: redis.Redis):
    with Connection(redis_url, transport=Transport) as connection:
        queue = connection.SimpleQueue("genq-broker-transport-index")
        queue.put({"n": 2})
        multi = _calls(redis_client, "multi")  # after the queue's declaration, which keeps kombu's own
        message = queue.get(timeout=10)
        tag = message.delivery_tag
        channel = queue.channel
        assert redis_client.hexists(channel.unacked_key, tag)
        assert redis_client.zscore(channel.unacked_index_key, tag) is not None
        message.ack()
        assert not redis_client.hexists(channel.unacked_key, tag)
        assert redis_client.zscore(channel.unacked_index_key, tag) is None
        assert _calls(redis_client, "multi") == multi
        queue.close()


def test_a_message_unacknowledged_past_the_visibility_timeout_is_restored(redis_url: str,
                                                                          redis_client: redis.Redis):
    options = {"visibility_timeout": 0}
    with Connection(redis_url, transport=Transport, transport_options=options) as connection:
        queue = connection.SimpleQueue("genq-broker-transport-restore")
        queue.put({"n": 3})
        taken = queue.get(timeout=10)
        assert taken.payload == {"n": 3}
        channel = queue.channel
        channel.qos.restore_visible(interval=1)
        assert not redis_client.hexists(channel.unacked_key, taken.delivery_tag)
        again = queue.get(timeout=10)
        assert again.payload == {"n": 3}
        again.ack()
        queue.close()
