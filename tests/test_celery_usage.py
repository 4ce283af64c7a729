"""genq as a Celery application sees it (docs/protocol.md section 10): a real
`genq worker`, a plain Celery worker running the user's own tasks, a plain
Celery client, and Flower. Revoke, chains, groups, chords, callbacks and
routing, the documented exc_type values, the engine lines and task events in Flower."""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord
from celery.exceptions import TaskRevokedError

from producer.protocol import TASK_NAME, ProtocolError, channel_name
from tests.service import RawPublisher, chunk_text, next_event, replay
from worker.processes import ROOT, ChildProcess, FlowerProcess, WorkerProcess, wait_until

QUEUE = "genq-celery"
ENGINE_OPTIONS = {"cache_tokens": 16384, "page_size": 16, "concurrency": 16}
DOC = ROOT / "docs" / "protocol.md"
SECTION = "## 10. Using genq from Celery"
USER_NODE = "user@celery-test"


def doc_blocks() -> list[str]:
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture(scope="module")
def worker(tiny_model_factory: Callable[..., Path], redis_url: str, client: Celery,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    process = WorkerProcess(model, redis_url, QUEUE, "celery-genq", tmp_path_factory.mktemp("genq") / "worker.log",
                            ENGINE_OPTIONS)
    with process:
        process.wait_ready(client)
        yield process


@pytest.fixture(scope="module")
def userapp(redis_url: str, client: Celery, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[ModuleType]:
    """The doc's `userapp.py`, written out as the user would, served by a plain Celery worker
    (no genq in it) on Celery's default queue, and imported here as the user's client code does."""
    folder = tmp_path_factory.mktemp("userapp")
    (folder / "userapp.py").write_text(doc_blocks()[0])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(folder), "REDIS_URL": redis_url, "GENQ_QUEUE": QUEUE}
    args = [sys.executable, "-m", "celery", "-A", "userapp", "worker", "--pool", "threads", "--concurrency", "4",
            "-Q", "celery,reports", "--hostname", USER_NODE, "--without-mingle", "--without-gossip",
            "--loglevel", "INFO"]
    plain = ChildProcess("user worker", args, folder / "worker.log", env)
    sys.path.insert(0, str(folder))
    with pytest.MonkeyPatch.context() as env_patch:
        env_patch.setenv("REDIS_URL", redis_url)
        env_patch.setenv("GENQ_QUEUE", QUEUE)
        import userapp as module  # noqa: PLC0415 - the module the doc tells the user to write

        with plain:
            def answers_ping() -> bool:
                plain.check_alive()
                return bool(client.control.ping(destination=[USER_NODE], timeout=0.5))

            wait_until(answers_ping, 60, "the plain Celery worker to answer ping")
            yield module
    sys.path.remove(str(folder))
    sys.modules.pop("userapp", None)


def raw_meta(redis_client: redis.Redis, task_id: str) -> dict[str, Any]:
    return json.loads(redis_client.get(f"celery-task-meta-{task_id}"))


def alone(userapp: ModuleType, **request: Any) -> str:
    """The text of `request` sent on its own (greedy, genq's default: the same text every time)."""
    return str(userapp.generate(**request).apply_async().get(timeout=60)["text"])


def test_the_celery_section_of_the_protocol_doc_runs_against_a_real_worker(
    worker: WorkerProcess, userapp: ModuleType, client: Celery, redis_client: redis.Redis
):
    blocks = doc_blocks()
    assert len(blocks) == 7
    namespace: dict[str, Any] = {"__name__": "doc"}
    for block in blocks[1:]:
        exec(compile(block, str(DOC), "exec"), namespace)
    doc = namespace
    assert doc["story"]["finish_reason"] in ("stop", "length")
    assert doc["running"].state == "REVOKED"
    assert replay(redis_client, doc["long_id"])[-1].event == "cancelled"
    # Chains: the child is the same chat run standalone with the parent's text as the last turn.
    parent_poem = doc["poem"].parent.get(timeout=60)["text"]
    assert doc["poem"].get()["text"] == alone(
        userapp, messages=[{"role": "system", "content": "Improve the poem you are given."},
                           {"role": "user", "content": parent_poem}], max_new_tokens=24)
    assert doc["words"].get() == len(doc["words"].parent.get()["text"].split())
    assert doc["haiku"].parent.get() == "Write a haiku about the sea."
    assert doc["haiku"].get()["text"] == alone(
        userapp, messages=[doc["poet"], {"role": "user", "content": "Write a haiku about the sea."}],
        max_new_tokens=24)
    # A group: in order, each what the same request gives alone.
    answers = doc["answers"].get()
    assert [answer["id"] for answer in answers] == [result.id for result in doc["answers"].results]
    assert [answer["text"] for answer in answers] == [alone(userapp, prompt=f"Question {i}:", max_new_tokens=8)
                                                      for i in range(3)]
    # A chord: the genq body got the header's texts joined as documented (in order, a blank line between).
    facts = [alone(userapp, prompt=f"Fact {i}:", max_new_tokens=8) for i in range(3)]
    assert doc["collected"].get() == facts
    assert doc["summary"].get()["text"] == alone(userapp, prompt="Summarize:\n" + "\n\n".join(facts),
                                                 max_new_tokens=16)
    # Callbacks: link gets the result, link_error the failed task's id, whose error the report shows.
    counted = userapp.app.AsyncResult(doc["counted_id"]).get(timeout=60)
    assert isinstance(counted, int)
    report = userapp.app.AsyncResult(doc["report_id"]).get(timeout=60)
    assert report == f"{doc['failing'].id} failed: max_new_tokens: Input should be greater than or equal to 1, got 0"
    # Routing: per-call queue, the user's tasks where their signature says or Celery's default queue.
    assert doc["direct"].get()["text"] == alone(userapp, prompt="Once upon a time", max_new_tokens=8)
    assert (doc["reported"].get(), doc["defaulted"].get()) == ("reports", "celery")
    assert doc["router"]("genq.generate", (), {"prompt": "Once upon a time"}, {}) == {"queue": f"{QUEUE}.route3"}
    assert doc["router"]("userapp.word_count", (), {}, {}) is None
    assert redis_client.llen(QUEUE) == 0 and "NotRegistered" not in worker.log_path.read_text()
    stats = worker.engine_stats(client)
    assert stats is not None and stats["pages_used"] == 0 and stats["active_jobs"] == 0


def start_long(userapp: ModuleType, redis_client: redis.Redis) -> tuple[Any, str]:
    """A long generation, returned once it has generated text."""
    identifier = f"revoke-{uuid.uuid4().hex[:8]}"
    watcher = redis_client.pubsub(ignore_subscribe_messages=True)
    watcher.subscribe(channel_name(identifier))
    handle = userapp.generate(prompt="a long story", max_new_tokens=900, ignore_eos=True).apply_async(
        task_id=identifier)
    while next_event(watcher).event != "chunk":
        pass
    watcher.close()
    return handle, identifier


def assert_revoked_like_a_cancel(worker: WorkerProcess, client: Celery, redis_client: redis.Redis, handle: Any,
                                 identifier: str) -> None:
    with pytest.raises(TaskRevokedError):
        handle.get(timeout=60)
    assert handle.state == "REVOKED"
    events = replay(redis_client, identifier)
    assert events[-1].event == "cancelled" and 0 < events[-1].usage.completion_tokens < 900
    assert chunk_text(events) == events[-1].text
    stats = worker.engine_stats(client)
    assert stats is not None and stats["pages_used"] == 0 and stats["active_jobs"] == 0


@pytest.mark.parametrize("terminate", [False, True])
def test_revoke_cancels_a_running_generation_as_genq_cancel_does(
    worker: WorkerProcess, userapp: ModuleType, client: Celery, redis_client: redis.Redis, terminate: bool
):
    cancelled_before = worker.engine_stats(client)["cancelled"]
    handle, identifier = start_long(userapp, redis_client)
    handle.revoke(terminate=terminate, signal="SIGKILL")
    assert_revoked_like_a_cancel(worker, client, redis_client, handle, identifier)
    assert worker.engine_stats(client)["cancelled"] == cancelled_before + 1


def test_revoke_before_start_never_runs_the_request(
    worker: WorkerProcess, userapp: ModuleType, client: Celery, redis_client: redis.Redis
):
    identifier = f"revoke-early-{uuid.uuid4().hex[:8]}"
    userapp.app.control.revoke(identifier)
    handle = userapp.generate(prompt="never runs", max_new_tokens=8).apply_async(task_id=identifier)
    with pytest.raises(TaskRevokedError):
        handle.get(timeout=60)
    assert replay(redis_client, identifier) == []


def test_flowers_revoke_button_cancels_a_running_generation(
    worker: WorkerProcess, userapp: ModuleType, client: Celery, redis_client: redis.Redis, redis_url: str,
    tmp_path: Path
):
    with FlowerProcess(redis_url, tmp_path / "flower.log") as flower:
        wait_until(lambda: flower.engine_stats([worker.node]), 60, "Flower to see the worker", interval=0.5)
        handle, identifier = start_long(userapp, redis_client)
        request = urllib.request.Request(f"{flower.url}api/task/revoke/{identifier}?terminate=true", data=b"",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert json.load(reply)["message"] == f"Revoked '{identifier}'"
        assert_revoked_like_a_cancel(worker, client, redis_client, handle, identifier)


def test_a_chain_child_without_chain_as_fails_itself_and_never_its_parent(
    worker: WorkerProcess, userapp: ModuleType, redis_client: redis.Redis
):
    misfits = [
        ({"prompt": "Then: "}, "chain_as: this task got its parent's result"),
        ({"messages": [{"role": "user", "content": "hi"}], "chain_as": "prompt_suffix"},
         "chain_as: 'prompt_suffix' appends to prompt"),
        ({"prompt": "Then: ", "chain_as": "user"}, "chain_as: 'user' appends a chat turn to messages"),
    ]
    for child_kwargs, problem in misfits:
        parent = userapp.generate(prompt="Once upon a time", max_new_tokens=8)
        child = chain(parent, userapp.generate(max_new_tokens=8, **child_kwargs)).apply_async()
        with pytest.raises(ProtocolError) as raised:
            child.get(timeout=60)
        assert str(raised.value).startswith(problem)
        assert raw_meta(redis_client, child.id)["result"]["exc_type"] == "ProtocolError"
        assert child.parent.state == "SUCCESS" and replay(redis_client, child.parent.id)[-1].event == "done"
        assert replay(redis_client, child.id)[-1].event == "error"


def test_a_chain_child_joins_its_parents_text_as_chain_as_says(
    worker: WorkerProcess, userapp: ModuleType
):
    joined = chain(userapp.generate(prompt="Once upon a time", max_new_tokens=8),
                   userapp.generate(prompt="Go on: ", chain_as="prompt_suffix", max_new_tokens=8)).apply_async()
    as_user = chain(userapp.generate(prompt="Once upon a time", max_new_tokens=8),
                    userapp.generate(messages=[{"role": "system", "content": "Be brief."}], chain_as="user",
                                     max_new_tokens=8)).apply_async()
    parent_text = joined.parent.get(timeout=60)["text"]
    alone = userapp.generate(prompt="Go on: " + parent_text, max_new_tokens=8).apply_async()
    assert joined.get(timeout=60)["text"] == alone.get(timeout=60)["text"]
    user_parent = as_user.parent.get(timeout=60)["text"]
    alone_chat = userapp.generate(messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": user_parent}], max_new_tokens=8).apply_async()
    assert as_user.get(timeout=60)["text"] == alone_chat.get(timeout=60)["text"]


def test_a_users_task_after_a_genq_task_goes_to_the_users_queue_not_genqs(
    worker: WorkerProcess, userapp: ModuleType, redis_client: redis.Redis
):
    counted = chain(userapp.generate(prompt="Once upon a time", max_new_tokens=16),
                    userapp.word_count.s()).apply_async()
    assert counted.get(timeout=60) == len(counted.parent.get()["text"].split())
    assert redis_client.llen(QUEUE) == 0
    assert "NotRegistered" not in worker.log_path.read_text()


def test_the_documented_exc_types_through_a_real_worker(
    worker: WorkerProcess, userapp: ModuleType, client: Celery, redis_client: redis.Redis, redis_url: str
):
    invalid = client.send_task(TASK_NAME, kwargs={"prompt": "x", "max_new_tokens": 0}, queue=QUEUE)
    too_long = client.send_task(TASK_NAME, kwargs={"input_ids": [5] * 1100, "max_new_tokens": 8}, queue=QUEUE)
    refused_id = f"refused-{uuid.uuid4().hex[:8]}"
    raw = RawPublisher(redis_url)
    raw.publish(QUEUE, {"prompt": "x"}, {"id": refused_id, "task": TASK_NAME, "lang": "py"})
    raw.close()
    for handle in (invalid, too_long, client.AsyncResult(refused_id)):
        with pytest.raises(ProtocolError):
            handle.get(timeout=60)
        meta = raw_meta(redis_client, handle.id)
        assert (meta["status"], meta["result"]["exc_type"], meta["result"]["exc_module"]) == (
            "FAILURE", "ProtocolError", "producer.protocol")
    identifier = f"twice-{uuid.uuid4().hex[:8]}"
    watcher = redis_client.pubsub(ignore_subscribe_messages=True)
    watcher.subscribe(channel_name(identifier))
    first = client.send_task(TASK_NAME, kwargs={"prompt": "a long story", "max_new_tokens": 900,
                                                "ignore_eos": True, "identifier": identifier}, queue=QUEUE)
    while next_event(watcher).event != "chunk":
        pass
    second = client.send_task(TASK_NAME, kwargs={"prompt": "x", "identifier": identifier}, queue=QUEUE)
    second.get(timeout=60, propagate=False)
    meta = raw_meta(redis_client, second.id)
    assert (meta["status"], meta["result"]["exc_type"], meta["result"]["exc_module"]) == (
        "FAILURE", "GenerationFailed", "worker.tasks")
    first.revoke()
    with pytest.raises(TaskRevokedError):
        first.get(timeout=60)
    assert raw_meta(redis_client, first.id)["result"]["exc_type"] == "TaskRevokedError"


def test_flower_shows_the_engine_stats_as_named_readable_lines(
    worker: WorkerProcess, redis_url: str, tmp_path: Path
):
    with FlowerProcess(redis_url, tmp_path / "flower.log") as flower:
        engines = wait_until(lambda: flower.engine_stats([worker.node]), 60,
                             "Flower to report the worker's engine stats", interval=0.5)
        with urllib.request.urlopen(f"{flower.url}worker/{worker.node}", timeout=10) as reply:
            page = reply.read().decode()
    engine = engines[worker.node]
    pages = ENGINE_OPTIONS["cache_tokens"] // ENGINE_OPTIONS["page_size"]
    assert re.fullmatch(rf"\d+ of {pages:,} pages in use \(\d+\.\d %\), [\d,]+ cached, [\d,]+ free; 16 tokens per "
                        r"page", engine["genq KV cache"]), engine
    assert re.fullmatch(r"\d+ running, \d+ waiting; peak batch \d+", engine["genq jobs"]), engine
    assert re.fullmatch(r"[\d,.]+ tokens/s over the last 10 s", engine["genq throughput"]), engine
    assert engine.keys() == {"genq jobs", "genq KV cache", "genq throughput", "genq tokens", "genq requests",
                             "genq preemptions", "genq speculative decoding", "genq engine loop"}
    assert all(isinstance(value, str) for value in engine.values())
    assert "genq KV cache" in page and "pages in use" in page and "{&#39;active_jobs" not in page
    assert "'active_jobs'" not in page


def test_flower_follows_each_generation_through_its_task_events(
    worker: WorkerProcess, client: Celery, redis_url: str, tmp_path: Path
):
    """The worker sends task events in batches (worker/consumer.py): Flower still sees every
    request received, started and succeeded on this worker."""

    def task_info(task_id: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{flower.url}api/task/info/{task_id}", timeout=10) as reply:
                info: dict[str, Any] = json.loads(reply.read())
        except urllib.error.HTTPError:
            return None  # not seen yet
        done = info.get("state") == "SUCCESS" and all(info.get(k) for k in ("received", "started", "succeeded"))
        return info if done else None

    with FlowerProcess(redis_url, tmp_path / "flower.log") as flower:
        wait_until(lambda: flower.engine_stats([worker.node]), 60, "Flower to see the worker", interval=0.5)
        handles = [client.send_task(TASK_NAME, kwargs={"prompt": f"event {i}", "max_new_tokens": 4}, queue=QUEUE)
                   for i in range(3)]
        for handle in handles:
            handle.get(timeout=60)
        infos = [wait_until(partial(task_info, handle.id), 30, f"Flower to show task {handle.id} succeeded",
                            interval=0.2) for handle in handles]
    assert all(info["worker"] == worker.node and info["name"] == TASK_NAME for info in infos)


@pytest.mark.parametrize("continued", [False, True])
def test_chain_as_assistant_appends_the_parents_text_as_the_assistants_turn(
    worker: WorkerProcess, userapp: ModuleType, continued: bool
):
    """After the assistant's turn the model answers it (a new turn), or, with continue_final_message,
    goes on with the parent's text: each the same chat standalone."""
    system = {"role": "system", "content": "Be brief."}
    options: dict[str, Any] = {"continue_final_message": True, "add_generation_prompt": False} if continued else {}
    chained = chain(userapp.generate(prompt="Once upon a time", max_new_tokens=8),
                    userapp.generate(messages=[system], chain_as="assistant", max_new_tokens=8, **options)
                    ).apply_async()
    parent_text = chained.parent.get(timeout=60)["text"]
    assert chained.get(timeout=60)["text"] == alone(
        userapp, messages=[system, {"role": "assistant", "content": parent_text}], max_new_tokens=8, **options)


def test_an_immutable_child_runs_its_own_request_without_the_parents_result(
    worker: WorkerProcess, userapp: ModuleType
):
    child = {"prompt": "Go on: ", "chain_as": "prompt_suffix", "max_new_tokens": 8}
    chained = chain(userapp.generate(prompt="Once upon a time", max_new_tokens=8),
                    userapp.generate(**child).set(immutable=True)).apply_async()
    assert chained.parent.get(timeout=60)["text"]
    result = chained.get(timeout=60)
    alone_result = userapp.generate(**child).apply_async().get(timeout=60)
    assert (result["text"], result["usage"]["prompt_tokens"]) == (alone_result["text"],
                                                                 alone_result["usage"]["prompt_tokens"])


def test_a_users_task_returning_a_string_is_a_genq_childs_parent(worker: WorkerProcess, userapp: ModuleType):
    chained = chain(userapp.topic.s("the moon"),
                    userapp.generate(prompt="Poem: ", chain_as="prompt_suffix", max_new_tokens=8)).apply_async()
    assert chained.get(timeout=60)["text"] == alone(userapp, prompt="Poem: Write a haiku about the moon.",
                                                    max_new_tokens=8)


def test_a_parent_result_without_text_fails_the_child_naming_it_and_never_the_parent(
    worker: WorkerProcess, userapp: ModuleType, redis_client: redis.Redis
):
    child = userapp.generate(prompt="Go on: ", chain_as="prompt_suffix", max_new_tokens=8)
    counted = chain(userapp.generate(prompt="Once upon a time", max_new_tokens=8), userapp.word_count.s(),
                    child.clone()).apply_async()
    facts = [userapp.generate(prompt=f"Fact {i}:", max_new_tokens=4) for i in range(2)]
    nested = chord([chord(facts, userapp.texts.s()), userapp.generate(prompt="More:", max_new_tokens=4)],
                   child.clone()).apply_async()
    for handle, problem in (
        (counted, "chain: the parent's result must be a genq result (an object with text), a string or an array "
                  "of those, got number "),
        (nested, "chain: the parent's result[0] must be a genq result (an object with text) or a string (a "
                 "group's results are joined one level deep), got array"),
    ):
        with pytest.raises(ProtocolError) as raised:
            handle.get(timeout=60)
        assert str(raised.value).startswith(problem)
        assert raw_meta(redis_client, handle.id)["result"]["exc_type"] == "ProtocolError"
        assert replay(redis_client, handle.id)[-1].event == "error"
    assert counted.parent.state == "SUCCESS" and counted.parent.parent.state == "SUCCESS"
    assert [result.state for result in nested.parent.results] == ["SUCCESS", "SUCCESS"]
