"""The control listener's sweep of cancel keys (worker/control.py) on the test Redis: a cancel whose
control message was lost still reaches the engine loop through its key, for exactly the running
requests that have one, and a quiet second with no cancel key costs one EXISTS, whatever the
number of running requests (issue 30)."""

from __future__ import annotations

import uuid

import redis

from producer.protocol import cancel_key
from worker.control import ControlListener


class RunningRequests:
    """The two calls of the engine loop the sweep makes: which requests run, and cancel one."""

    def __init__(self, identifiers: list[str]) -> None:
        self.identifiers = identifiers
        self.cancelled: list[str] = []

    def active_identifiers(self) -> list[str]:
        return list(self.identifiers)

    def cancel(self, identifier: str) -> None:
        self.cancelled.append(identifier)


def _exists_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


def test_the_sweep_cancels_the_running_requests_with_a_cancel_key_in_one_exists_while_none_has(
    redis_client: redis.Redis,
):
    prefix = f"sweep-{uuid.uuid4().hex[:8]}"
    running = RunningRequests([f"run-{i}" for i in range(64)])
    listener = ControlListener(redis_client, prefix, "genq-sweep", running, None, None)  # type: ignore[arg-type]
    try:
        before = _exists_calls(redis_client)
        listener._sweep_cancel_keys()
        assert _exists_calls(redis_client) - before == 1 and running.cancelled == []
        redis_client.set(cancel_key("run-7", prefix), 1, ex=60)
        redis_client.set(cancel_key("run-40", prefix), 1, ex=60)
        redis_client.set(cancel_key("not-running", prefix), 1, ex=60)
        listener._sweep_cancel_keys()
        assert running.cancelled == ["run-7", "run-40"]
    finally:
        listener.pubsub.close()
