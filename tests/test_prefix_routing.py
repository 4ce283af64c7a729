"""Prefix-aware routing (issue 14, opt-in): requests that start alike reach
one worker, whose prefix cache then serves the shared start; settings that
would leave a route without meaning are refused naming the variable."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from producer.client import GenqClient
from producer.routing import prefix_route, route_queue
from producer.settings import ClientSettings
from worker.processes import WorkerProcess
from worker.settings import Settings

QUEUE = "genq-routes"


def system(team: str) -> str:
    """A system prompt longer than the routed start (256 characters by default), differing by team."""
    return f"You are a careful assistant for the {team} team. " + "Answer briefly and cite the runbook. " * 8


def test_requests_sharing_their_start_share_a_route_and_routes_all_get_used():
    settings = ClientSettings(queue="q", prefix_routes=4, prefix_route_chars=64)
    start = "x" * 64
    assert len({settings.queue_for({"prompt": start + tail}) for tail in ("a", "b", "a much longer tail")}) == 1
    chat = [{"role": "system", "content": system("billing")}]
    assert (settings.queue_for({"messages": [*chat, {"role": "user", "content": "one"}]})
            == settings.queue_for({"messages": [*chat, {"role": "user", "content": "two"}]}))
    used = {settings.queue_for({"prompt": f"team {i}: " + start}) for i in range(64)}
    assert used == {route_queue("q", route) for route in range(4)}
    assert ClientSettings(queue="q").queue_for({"prompt": "anything"}) == "q"  # off by default


def test_a_worker_route_outside_the_routes_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=re.escape("GENQ_PREFIX_ROUTE: route 2 needs GENQ_PREFIX_ROUTES above 2")):
        Settings(prefix_routes=2, prefix_route="0,2")
    with pytest.raises(ValueError, match="prefix_route"):
        Settings(prefix_routes=2, prefix_route="zero")
    assert Settings(queue="q", prefix_routes=3, prefix_route="2,0").queues == ["q", "q.route0", "q.route2"]


def test_each_worker_serves_the_requests_of_its_routes(
    tiny_model_factory: Callable[..., Path], redis_url: str, client: Celery, tmp_path: Path
):
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    options = {"cache_tokens": 4096, "page_size": 16, "concurrency": 8, "prefix_routes": 2}
    workers = [WorkerProcess(model, redis_url, QUEUE, f"route{i}", tmp_path / f"route{i}.log",
                             {**options, "prefix_route": i}).start() for i in range(2)]
    producer = GenqClient(redis_url, queue=QUEUE)
    producer.settings = producer.settings.model_copy(update={"prefix_routes": 2})
    # One team's system prompt per route (found by the route function itself, as a producer would).
    teams = {prefix_route({"prompt": system(team)}, 2, producer.settings.prefix_route_chars): team
             for team in ("billing", "search", "storage", "identity", "mobile", "payments")}
    assert sorted(teams) == [0, 1]
    try:
        for worker in workers:
            worker.wait_ready(client)
        for route, team in sorted(teams.items()):
            before = [w.engine_stats(client)["generated_tokens"] for w in workers]
            handles = [producer.submit({"prompt": system(team) + f"Question {i}?", "max_new_tokens": 4,
                                        "ignore_eos": True}) for i in range(6)]
            assert all(h.result(timeout=120).usage.completion_tokens == 4 for h in handles)
            after = [w.engine_stats(client) for w in workers]
            assert after[route]["generated_tokens"] - before[route] == 24
            assert after[1 - route]["generated_tokens"] == before[1 - route]
            assert after[route]["prompt_tokens_cached"] > 0  # the shared start came from its prefix cache
    finally:
        producer.close()
        for worker in workers:
            worker.stop()
