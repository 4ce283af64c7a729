"""The client library against a real redis-server and a real worker process
(its own queue), plus the ordering logic on synthetic events."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from producer.client import (
    PUBSUB_CLIENT_NAME,
    AsyncGenqClient,
    GenerationError,
    GenerationHandle,
    GenqClient,
    StreamRestarted,
    TextAssembler,
    _Follower,
)
from producer.protocol import STREAM_FIELD, Choice, ProtocolError, StreamEvent, channel_name, stream_key
from tests.service import chunk_text
from worker.processes import WorkerProcess, wait_until

QUEUE = "genq-client"
LONG = {"max_new_tokens": 400, "ignore_eos": True}
"""Long enough (about a second) to act on a request while it runs."""


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "client", concurrency=64)


@pytest.fixture(scope="module")
def client(worker: WorkerProcess, redis_url: str) -> Iterator[GenqClient]:
    with GenqClient(redis_url, queue=QUEUE) as client:
        yield client


@pytest.fixture(scope="module")
def admin(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def check_events(events: list[StreamEvent], text: str) -> None:
    """One attempt, complete: started, chunks, one final event; seq contiguous; text consistent."""
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].event == "started" and events[-1].is_terminal
    assert not any(e.is_terminal for e in events[:-1])
    assert chunk_text(events) == events[-1].text == text


def kill_followers(admin: redis.Redis) -> int:
    """Drop the connections that follow streams (the client's pub/sub ones), nothing else."""
    ids = [c["id"] for c in admin.client_list() if c["name"] == PUBSUB_CLIENT_NAME]
    return sum(admin.client_kill_filter(_id=i) for i in ids)


# --- Against the worker ------------------------------------------------------------


def test_submit_streams_every_event_once_and_its_text_is_the_result(client: GenqClient):
    handle = client.submit({"prompt": "Once upon a time", "max_new_tokens": 40})
    events = list(handle.events(timeout=60))
    result = handle.result(timeout=60)
    check_events(events, result.text)
    assert result.id == handle.id and result.finish_reason in ("stop", "length")
    assert "".join(handle.stream(timeout=60)) == result.text  # again, from the replay stream
    assert handle.state == "SUCCESS"


def test_one_token_generations_lose_no_event(client: GenqClient):
    """Done before anyone reads: what was published before the iteration comes from the replay."""
    handles = [client.submit({"prompt": f"quick {i}", "max_new_tokens": 1}) for i in range(8)]
    time.sleep(0.5)
    for handle in handles:
        events = list(handle.events(timeout=60))
        assert [e.event for e in events][0] == "started" and events[-1].event == "done"
        check_events(events, handle.result(timeout=60).text)


def test_attaching_after_the_end_replays_the_whole_stream(client: GenqClient):
    original = client.submit({"prompt": "Attach later", "max_new_tokens": 24})
    first = list(original.events(timeout=60))
    later = client.handle(original.id)
    assert [e.to_json() for e in later.events(timeout=10)] == [e.to_json() for e in first]
    assert later.result(timeout=10).text == first[-1].text


def test_resume_after_the_last_seen_event_gives_the_rest(client: GenqClient):
    handle = client.submit({"prompt": "Resume me", **LONG})
    seen = []
    for event in handle.events(timeout=60):
        seen.append(event)
        if len(seen) == 5:
            break
    rest = list(client.handle(handle.id).events(timeout=60, after=(seen[-1].attempt, seen[-1].seq)))
    assert rest[0].seq == seen[-1].seq + 1
    check_events(seen + rest, handle.result(timeout=60).text)
    assert list(client.handle(handle.id).events(timeout=10, after=(rest[-1].attempt, rest[-1].seq))) == []


def test_a_dropped_connection_is_resumed_without_gap_or_duplicate(client: GenqClient, admin: redis.Redis):
    handle = client.submit({"prompt": "Connection trouble", **LONG})
    events = []
    killed = 0
    for event in handle.events(timeout=60):
        events.append(event)
        if len(events) == 3:
            killed = kill_followers(admin)
            time.sleep(0.3)  # events published meanwhile reach no subscriber
    assert killed >= 1
    check_events(events, handle.result(timeout=60).text)


def test_what_pubsub_loses_is_read_from_the_stream(redis_url: str, admin: redis.Redis,
                                                   monkeypatch: pytest.MonkeyPatch):
    """A publisher that drops a live message and never publishes the final event (only XADDs it):
    the hole is filled from the stream at once, the end is found by the silence poll."""
    monkeypatch.setattr("producer.client.POLL_INTERVAL_S", 0.2)
    events = [event(1, 0, "started"), *(event(1, i, text=f"{i} ") for i in range(1, 5)),
              event(1, 5, "done", "1 2 3 4 ")]
    events = [e.model_copy(update={"id": "lossy"}) for e in events]

    def publish() -> None:
        wait_until(lambda: admin.pubsub_numsub(channel_name("lossy"))[0][1] == 1, 10, "the reader to subscribe")
        for e in events:
            admin.xadd(stream_key("lossy"), {STREAM_FIELD: e.to_json()})
            if e.seq not in (2, 5):
                admin.publish(channel_name("lossy"), e.to_json())

    with GenqClient(redis_url, queue="nobody-serves-this") as client:
        publisher = threading.Thread(target=publish)
        publisher.start()
        assert list(client.handle("lossy").events(timeout=10)) == events
        publisher.join()


def test_invalid_requests_fail_locally_and_worker_failures_carry_its_message(client: GenqClient):
    with pytest.raises(ProtocolError, match="sampling.temperature"):
        client.submit({"prompt": "x", "sampling": {"temperature": 5}, "identifier": "never-sent"})
    assert client.handle("never-sent").state == "PENDING"
    with pytest.raises(ProtocolError, match="identifier"):
        client.handle("bad id!")

    handle = client.submit({"input_ids": [5, 10**6], "max_new_tokens": 4})
    with pytest.raises(GenerationError, match="vocabulary") as failure:
        handle.result(timeout=60)
    assert failure.value.identifier == handle.id and "vocabulary" in failure.value.message
    events = list(handle.events(timeout=10))
    assert [e.event for e in events] == ["error"] and events[0].error == failure.value.message
    with pytest.raises(GenerationError, match="vocabulary"):
        list(handle.stream(timeout=10))


def test_cancel_mid_stream_ends_the_stream_and_the_result_says_so(client: GenqClient):
    handle = client.submit({"prompt": "Cancel me", **LONG})
    events = []
    for event in handle.events(timeout=60):
        events.append(event)
        if event.event == "chunk" and len(events) == 3:
            handle.cancel()
    result = handle.result(timeout=60)
    assert events[-1].event == "cancelled" and result.finish_reason == "cancelled"
    assert 0 < result.usage.completion_tokens < LONG["max_new_tokens"]
    check_events(events, result.text)


def test_submit_many_sends_them_all(client: GenqClient):
    handles = client.submit_many({"prompt": f"bulk {i}", "max_new_tokens": 8} for i in range(16))
    assert len({h.id for h in handles}) == 16
    results = [h.result(timeout=120) for h in handles]
    assert [r.id for r in results] == [h.id for h in handles]
    assert all(r.finish_reason in ("stop", "length") for r in results)
    check_events(list(handles[-1].events(timeout=10)), results[-1].text)


def test_an_expired_replay_stream_falls_back_to_the_result(client: GenqClient, admin: redis.Redis):
    handle = client.submit({"prompt": "Expiring", "max_new_tokens": 8})
    result = handle.result(timeout=60)
    admin.delete(stream_key(handle.id))
    [event] = client.handle(handle.id).events(timeout=10)
    assert (event.event, event.text, event.finish_reason) == ("done", result.text, result.finish_reason)


def test_the_async_client_submits_streams_cancels_and_resumes(worker: WorkerProcess, redis_url: str,
                                                             admin: redis.Redis):
    async def scenario() -> None:
        async with AsyncGenqClient(redis_url, queue=QUEUE) as client:
            handle = await client.submit({"prompt": "Async story", "max_new_tokens": 32})
            text = "".join([piece async for piece in handle.stream(timeout=60)])
            assert (await handle.result(timeout=60)).text == text
            assert await handle.state() == "SUCCESS"

            long = await client.submit({"prompt": "Async cancel", **LONG})
            events = []
            async for event in long.events(timeout=60):
                events.append(event)
                if len(events) == 3:
                    assert kill_followers(admin) >= 1
                    await asyncio.sleep(0.3)
                if len(events) == 6:
                    await long.cancel()
            result = await long.result(timeout=60)
            assert events[-1].event == "cancelled" and result.finish_reason == "cancelled"
            check_events(events, result.text)

            attached = client.handle(handle.id)
            assert (await attached.result(timeout=5)).text == text  # from the backend, no replay needed
            assert "".join([e.text async for e in attached.events(timeout=10) if e.event == "chunk"]) == text
            with pytest.raises(TimeoutError):
                await client.handle("async-unknown").result(timeout=0)

            many = await client.submit_many([{"prompt": f"async bulk {i}", "max_new_tokens": 4} for i in range(4)])
            results = await asyncio.gather(*(h.result(timeout=60) for h in many))
            assert [r.id for r in results] == [h.id for h in many]

            failed = await client.submit({"input_ids": [10**6], "max_new_tokens": 4})
            with pytest.raises(GenerationError, match="vocabulary"):
                await failed.result(timeout=60)

    asyncio.run(scenario())


# --- Ordering and text, on synthetic events ----------------------------------------


def event(attempt: int, seq: int, kind: str = "chunk", text: str = "") -> StreamEvent:
    finish = {"done": "stop", "cancelled": "cancelled", "error": "error"}.get(kind)
    return StreamEvent(id="r", attempt=attempt, seq=seq, event=kind, text=text, finish_reason=finish,
                       error="boom" if kind == "error" else None)


def test_the_follower_takes_each_event_once_and_notices_holes():
    follower = _Follower(None)
    assert follower.replayed([event(1, 0, "started"), event(1, 1)], "1-1") == [event(1, 0, "started"), event(1, 1)]
    assert not follower.take(event(1, 1))  # the same event from the channel
    assert follower.skips_ahead(event(1, 3)) and not follower.skips_ahead(event(1, 2))
    assert follower.skips_ahead(event(2, 1)) and not follower.skips_ahead(event(2, 0, "started"))
    assert follower.take(event(1, 2)) and follower.last_entry_id == "1-1"
    assert follower.take(event(2, 0, "started"))  # redelivered: a new attempt
    assert not follower.take(event(1, 3))  # left over from the old attempt
    assert follower.take(event(2, 1, "done")) and follower.finished
    assert not follower.take(event(2, 2))


def test_a_final_event_followed_by_a_newer_attempt_does_not_end_the_replay():
    follower = _Follower(None)
    replay = [event(1, 0, "started"), event(1, 1, "error"), event(2, 0, "started"), event(2, 1, "done")]
    assert follower.replayed(replay, "9-0") == replay and follower.finished


def test_resuming_right_after_the_final_event_ends_at_once():
    follower = _Follower((1, 2))
    assert follower.replayed([event(1, 0, "started"), event(1, 1), event(1, 2, "done")], "3-0") == []
    assert follower.finished


def test_a_redelivered_attempt_with_the_same_text_continues_the_stream():
    text = TextAssembler("r")
    shown = [text.feed(e) for e in (event(1, 0, "started"), event(1, 1, text="Once "), event(1, 2, text="upon"))]
    shown += [text.feed(e) for e in (event(2, 0, "started"), event(2, 1, text="On"), event(2, 2, text="ce up"),
                                     event(2, 3, text="on a"), event(2, 4, "done", "Once upon a"))]
    assert "".join(shown) == "Once upon a" and shown[-2:] == [" a", ""]


def test_a_redelivered_attempt_with_another_text_restarts_the_stream():
    text = TextAssembler("r")
    assert text.feed(event(1, 1, text="Once upon")) == "Once upon"
    with pytest.raises(StreamRestarted) as restart:
        text.feed(event(2, 1, text="Twice"))
    assert restart.value.attempt == 2 and text.reset() == "Twice"
    assert text.feed(event(2, 2, "done", "Twice more")) == " more"
    with pytest.raises(GenerationError, match="boom"):
        text.feed(event(3, 0, "error"))


def test_a_request_without_chunks_gets_its_text_from_the_final_event():
    text = TextAssembler("r")
    assert text.feed(event(1, 0, "started")) == "" and text.feed(event(1, 1, "done", "all at once")) == "all at once"


def test_an_assembler_follows_one_sample_of_an_n_request_redelivery_included():
    def chunk(attempt: int, seq: int, index: int, text: str) -> StreamEvent:
        return StreamEvent(id="r", attempt=attempt, seq=seq, event="chunk", text=text, index=index)

    final = StreamEvent(id="r", attempt=2, seq=3, event="done", text="Once", finish_reason="stop", choices=[
        Choice(index=0, text="Once", finish_reason="stop"), Choice(index=1, text="Twice more", finish_reason="length")])
    first, second = TextAssembler("r", 0), TextAssembler("r", 1)
    events = [chunk(1, 1, 0, "On"), chunk(1, 2, 1, "Twi"), chunk(2, 1, 1, "Twice"), chunk(2, 2, 0, "Once"), final]
    assert [first.feed(e) for e in events] == ["On", "", "", "ce", ""]
    assert [second.feed(e) for e in events] == ["", "Twi", "ce", "", " more"]
    cancelled_early = StreamEvent(id="r", attempt=1, seq=1, event="cancelled", finish_reason="cancelled")
    assert TextAssembler("r", 1).feed(cancelled_early) == ""


def test_the_client_is_configured_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GENQ_REDIS_URL", "redis://127.0.0.1:1/3")
    monkeypatch.setenv("GENQ_QUEUE", "from-env")
    monkeypatch.setenv("GENQ_KEY_PREFIX", "pfx")
    monkeypatch.setenv("GENQ_VISIBILITY_TIMEOUT_S", "120")
    client = GenqClient(queue="from-arg")
    assert (client.queue, client.key_prefix, client.settings.redis_url) == ("from-arg", "pfx", "redis://127.0.0.1:1/3")
    options = client.celery.conf.broker_transport_options
    assert options["visibility_timeout"] == 120 and options["priority_steps"] == list(range(10))
    assert client.celery.conf.accept_content == ["json"]
    with pytest.raises(ProtocolError, match="prefix"):
        GenqClient(key_prefix="bad prefix")
    client.close()


def test_an_identifier_given_twice_must_agree(client: GenqClient):
    with pytest.raises(ProtocolError, match="given twice"):
        client.submit({"prompt": "x", "identifier": "one"}, identifier="two")
    with pytest.raises(ProtocolError, match="more than one request"):
        client.submit_many([{"prompt": "x", "identifier": "same"}, {"prompt": "y", "identifier": "same"}])


def test_handles_are_iterable_twice(client: GenqClient):
    handle: GenerationHandle = client.submit({"prompt": "Twice", "max_new_tokens": 6})
    assert list(handle.events(timeout=60)) == list(handle.events(timeout=10))
