"""Three workers on one queue and one Redis: tasks spread across them, a SIGKILL of one
mid-run loses nothing, and Flower shows the survivors' engine stats."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis
from celery import Celery

from producer.protocol import TASK_NAME
from tests.service import replay
from worker.processes import FlowerProcess, WorkerProcess, wait_until

QUEUE = "genq-many"
TASKS = 36
# Long enough that the first worker is still generating when it is killed (checked just before).
TOKENS = 600


def test_three_workers_share_a_queue_and_a_sigkill_of_one_loses_nothing(
    tiny_model_factory: Callable[..., Path], redis_url: str, client: Celery, redis_client: redis.Redis,
    tmp_path: Path
):
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    # 12 tasks in flight per worker at most, so the queue cannot all go to the first one.
    options = {"cache_tokens": 8192, "page_size": 16, "concurrency": 12, "visibility_timeout": 20}
    workers = [WorkerProcess(model, redis_url, QUEUE, f"many{i}", tmp_path / f"many{i}.log", options).start()
               for i in range(3)]
    flower = FlowerProcess(redis_url, tmp_path / "flower.log").start()
    try:
        for worker in workers:
            worker.wait_ready(client)
        handles = [client.send_task(TASK_NAME, kwargs={"prompt": f"many {i}", "max_new_tokens": TOKENS,
                                                       "ignore_eos": True, "identifier": f"many-{i}"},
                                    task_id=f"many-{i}", queue=QUEUE) for i in range(TASKS)]

        def all_generating() -> bool:
            stats = [w.engine_stats(client) for w in workers]
            return all(s and s["active_jobs"] > 0 and s["generated_tokens"] > 0 for s in stats)

        wait_until(all_generating, 120, "every worker to be generating")
        # Killed first, while it is surely generating: on a loaded machine the Flower reading below
        # can take long enough for a worker to finish its share.
        doomed = workers[0].engine_stats(client)
        assert doomed is not None and doomed["active_jobs"] > 0, doomed
        workers[0].kill()
        survivors = workers[1:]

        def flower_shows_submissions() -> dict[str, dict[str, str]] | None:
            # Flower keeps a worker's last inspect reply when a busy worker misses its inspect
            # timeout (1 s), so an early reading can predate the submissions: wait for a fresh one.
            engines = flower.engine_stats([w.node for w in survivors])
            if engines is None or any(e["genq requests"].startswith("0 submitted") for e in engines.values()):
                return None
            return engines

        wait_until(flower_shows_submissions, 60, "Flower to report the surviving engines with their submissions",
                   interval=0.5)
        results = [handle.get(timeout=300) for handle in handles]
        assert all(r["usage"]["completion_tokens"] == TOKENS for r in results)
        assert any(r["attempt"] == 2 for r in results)  # the killed worker's tasks ran again elsewhere
        for i in range(TASKS):
            events = replay(redis_client, f"many-{i}")
            finals = [e for e in events if e.is_terminal]
            assert len(finals) == 1 and events[-1].is_terminal
        survivor_stats = [w.engine_stats(client) for w in survivors]
        assert all(s is not None and s["completed"] > 0 for s in survivor_stats)
    finally:
        flower.stop(10)
        for worker in workers:
            worker.stop()
