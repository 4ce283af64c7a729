"""Redis Sentinel (issue 14): a worker and a client given only Sentinel URLs
serve a request end to end, and after a Sentinel failover (the replica becomes
the master) they follow it and serve the next one, with no process restarted."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from producer.client import GenqClient
from worker.processes import ChildProcess, RedisServer, WorkerProcess, free_port, reachable, wait_until

MASTER = "genqmaster"
QUEUE = "genq-sentinel"


class Sentinel:
    """`redis-server <conf> --sentinel` watching one master, quorum 1, quick failure detection."""

    def __init__(self, workdir: Path, master_port: int) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.conf = workdir / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {workdir}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
        )
        binary = shutil.which("redis-server")
        assert binary is not None
        self.process = ChildProcess("sentinel", [binary, str(self.conf), "--sentinel"], workdir / "sentinel.log")
        self.process.start()
        self.client = redis.Redis(port=self.port, socket_connect_timeout=1, decode_responses=True)
        wait_until(lambda: reachable(f"redis://127.0.0.1:{self.port}"), 20, "the Sentinel to answer PING")

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.port}/0"

    def master_port(self) -> int:
        return int(self.client.sentinel_get_master_addr_by_name(MASTER)[1])

    def stop(self) -> None:
        self.process.stop(20)


@pytest.fixture()
def sentinel_setup(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer, Sentinel]]:
    master = RedisServer(tmp_path / "master").start()
    replica = RedisServer(tmp_path / "replica", replica_of=master.port).start()
    sentinel = Sentinel(tmp_path / "sentinel", master.port)
    try:
        wait_until(lambda: sentinel.client.sentinel_slaves(MASTER), 30, "the Sentinel to discover the replica")
        yield master, replica, sentinel
    finally:
        sentinel.stop()
        replica.stop()
        master.stop()


def test_worker_and_client_on_sentinel_urls_follow_a_failover(
    sentinel_setup: tuple[RedisServer, RedisServer, Sentinel], tiny_model_factory: Callable[..., Path],
    tmp_path: Path
):
    master, replica, sentinel = sentinel_setup
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    worker = WorkerProcess(model, sentinel.url, QUEUE, "sentinel", tmp_path / "worker.log",
                           {"cache_tokens": 4096, "page_size": 16, "concurrency": 4, "visibility_timeout": 60},
                           env={"GENQ_SENTINEL_MASTER": MASTER})
    client = GenqClient(sentinel.url, queue=QUEUE, sentinel_master=MASTER)
    with worker:
        worker.wait_ready(client.celery)
        before = client.submit({"prompt": "before the failover", "max_new_tokens": 8, "ignore_eos": True}
                               ).result(timeout=60)
        assert before.usage.completion_tokens == 8
        assert redis.Redis(port=master.port).exists(f"celery-task-meta-{before.id}")

        sentinel.client.execute_command("SENTINEL", "FAILOVER", MASTER)
        wait_until(lambda: sentinel.master_port() == replica.port, 60, "the Sentinel to promote the replica")
        wait_until(lambda: redis.Redis(port=replica.port).info("replication")["role"] == "master", 30,
                   "the replica to take the master role")
        wait_until(lambda: redis.Redis(port=master.port).info("replication").get("master_link_status") == "up", 30,
                   "the old master to become the new master's replica")

        after = client.submit({"prompt": "after the failover", "max_new_tokens": 8, "ignore_eos": True}
                              ).result(timeout=120)
        assert after.usage.completion_tokens == 8
        assert redis.Redis(port=replica.port).exists(f"celery-task-meta-{after.id}")
        worker.check_alive()
    client.close()


@pytest.mark.parametrize(("env", "message"), [
    ({"GENQ_REDIS_URL": "sentinel://127.0.0.1:26379/0"}, "GENQ_REDIS_URL is a Sentinel URL: set GENQ_SENTINEL_MASTER"),
    ({"GENQ_BROKER_URL": "sentinel://h:1;redis://h:2", "GENQ_SENTINEL_MASTER": "m"},
     "GENQ_BROKER_URL: 'redis://h:2': each ';'-separated part of a Sentinel URL must be sentinel://host:port"),
    ({"GENQ_RESULT_BACKEND": "sentinel://h:1/zero", "GENQ_SENTINEL_MASTER": "m"},
     "GENQ_RESULT_BACKEND: 'sentinel://h:1/zero': the database must be a number"),
])
def test_unusable_sentinel_settings_are_refused_naming_the_variable(
    env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        GenqClient()
