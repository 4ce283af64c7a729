"""`genq submit | stream | cancel | result` as a script would run them: subprocesses
against a real redis-server and a real worker on its own queue."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from producer.protocol import control_channel, stream_key
from worker.processes import ROOT, WorkerProcess, free_port, wait_until

QUEUE = "genq-cli"


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "cli")


@pytest.fixture(scope="module")
def genq(worker: WorkerProcess, redis_url: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command(redis_url, *args), cwd=ROOT, input=stdin, capture_output=True, text=True,
                              timeout=120)

    return run


def command(redis_url: str, name: str, *args: str) -> list[str]:
    options = ["--redis-url", redis_url] + (["--queue", QUEUE] if name == "submit" else [])
    return [sys.executable, "-m", "worker.cli", name, *options, *args]


def result_of(genq: Callable[..., subprocess.CompletedProcess[str]], identifier: str) -> dict:
    done = genq("result", identifier, "--wait", "30", "--json")
    assert done.returncode in (0, 3), done.stderr
    return json.loads(done.stdout)


def test_streamed_stdout_is_the_result_text_and_stderr_has_the_status(genq):
    run = genq("submit", "Once upon a time", "--stream", "--max-new-tokens", "24", "--id", "cli-stream")
    assert run.returncode == 0, run.stderr
    result = result_of(genq, "cli-stream")
    assert run.stdout == result["text"] and run.stdout
    assert "[done: length] 24 tokens" in run.stderr and "id cli-stream" in run.stderr


def test_submit_prints_the_id_then_the_text_or_the_json_result(genq):
    run = genq("submit", "-", "--max-new-tokens", "8", "--seed", "3", "--temperature", "0.8", stdin="From stdin")
    assert run.returncode == 0, run.stderr
    identifier = run.stderr.splitlines()[0]
    assert run.stdout == result_of(genq, identifier)["text"]

    as_json = genq("submit", "--input-ids", "5,6,7", "--max-new-tokens", "4", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0}


def test_constraints_and_logprobs_from_the_command_line(genq, tmp_path: Path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    run = genq("submit", "Answer", "--json-schema", str(schema), "--max-new-tokens", "20")
    assert run.returncode == 0, run.stderr
    assert set(json.loads(run.stdout)) == {"ok"}
    picked = genq("submit", "Pick", "--choice", "red", "--choice", "blue", "--top-logprobs", "2", "--json")
    assert picked.returncode == 0, picked.stderr
    result = json.loads(picked.stdout)
    assert result["text"] in ("red", "blue") and len(result["logprobs"]) == len(result["token_ids"])
    both = genq("submit", "x", "--regex", "a+", "--choice", "b")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_chat_messages_from_a_file(genq, tmp_path: Path):
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Hello there"}]))
    run = genq("submit", "--messages", str(messages), "--max-new-tokens", "6", "--stream", "--json")
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in run.stdout.splitlines()]
    assert events[0]["event"] == "started" and events[-1]["event"] == "done"


def test_stream_and_result_of_a_finished_request(genq):
    assert genq("submit", "Later", "--max-new-tokens", "12", "--id", "cli-later").returncode == 0
    text = result_of(genq, "cli-later")["text"]
    streamed = genq("stream", "cli-later")
    assert streamed.returncode == 0 and streamed.stdout == text
    shown = genq("result", "cli-later")
    assert shown.returncode == 0 and shown.stdout == text
    unknown = genq("result", "cli-unknown", "--wait", "0.2")
    assert unknown.returncode == 4 and "PENDING" in unknown.stderr


def test_invalid_arguments_exit_2_with_the_protocol_message(genq, tmp_path: Path):
    cases = [
        (["Hi", "--temperature", "5"], "sampling.temperature"),
        (["--max-new-tokens", "4"], "exactly one of prompt, messages or input_ids"),
        (["--input-ids", "1,x"], "--input-ids"),
        (["--messages", str(tmp_path / "missing.json")], "--messages"),
        (["Hi", "--id", "bad id!"], "identifier"),
    ]
    for args, message in cases:
        run = genq("submit", *args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
    assert genq("submit", "Hi", "--max-new-tokens", "many").returncode == 2  # argparse's own


def test_images_from_the_command_line_reach_the_worker(genq, tmp_path: Path):
    """--image PATH (issue 27): as `images` with a prompt, as image parts of the last user message with
    --messages; this worker's tiny Llama takes none, and says so naming each image's field path."""
    image = tmp_path / "red.png"
    image.write_bytes(base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSu"
                                       "QmCC"))
    run = genq("submit", "<image> <image> compare", "--image", str(image), "--image", str(image))
    assert run.returncode == 1, run.stderr
    assert "images[0]: this worker's model takes no images" in run.stderr and "images[1]:" in run.stderr
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "What is it?"}]))
    run = genq("submit", "--messages", str(chat), "--image", str(image), "--stream")
    assert run.returncode == 1 and "messages[0].content[1]: this worker's model takes no images" in run.stderr
    for args, message in [(["Hi", "--image", str(tmp_path / "missing.png")], "--image"),
                          (["--input-ids", "1,2", "--image", str(image)], "images: only with prompt")]:
        run = genq("submit", *args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
    shown = subprocess.run([sys.executable, "-m", "worker.cli", "submit", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert "--image PATH" in shown.stdout and "images.placeholder" in shown.stdout


def test_a_worker_side_failure_exits_1_with_the_worker_message(genq):
    for mode in ([], ["--stream"]):
        run = genq("submit", "--input-ids", "5,1000000", "--max-new-tokens", "4", *mode)
        assert run.returncode == 1 and "vocabulary" in run.stderr, run.stderr


def test_cancel_from_a_second_process_exits_3(genq, redis_url: str):
    identifier = "cli-cancel"
    streaming = subprocess.Popen(
        command(redis_url, "submit", "A long story", "--stream", "--ignore-eos", "--max-new-tokens", "900",
                "--id", identifier),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    admin = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: streaming.poll() is not None or admin.xlen(stream_key(identifier)) >= 3, 60,
                   "the request to stream")
        cancel = genq("cancel", identifier)
        assert cancel.returncode == 0, cancel.stderr
        out, err = streaming.communicate(timeout=60)
    finally:
        streaming.kill()
    assert streaming.returncode == 3, err
    result = result_of(genq, identifier)
    assert result["finish_reason"] == "cancelled" and out == result["text"]
    assert "[cancelled: cancelled]" in err


def test_a_deadline_exits_4(genq):
    run = genq("submit", "Slow", "--ignore-eos", "--max-new-tokens", "900", "--timeout", "0.5", "--json")
    assert run.returncode == 4, run.stderr
    assert json.loads(run.stdout)["finish_reason"] == "deadline"


def test_unreachable_redis_exits_5():
    run = subprocess.run(command(f"redis://127.0.0.1:{free_port()}/0", "submit", "Hi"), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 5 and "cannot reach Redis" in run.stderr, run.stderr


def test_the_client_and_cli_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import producer.client, producer.cli, worker.cli; "
            "worker.cli.build_parser().parse_args(['submit', 'x'])")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_adapters_load_and_unload_publish_the_control_messages(genq, redis_url: str):
    admin = redis.Redis.from_url(redis_url)
    pubsub = admin.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(control_channel())
    try:
        load = genq("adapters", "--queue", "genq-cli-lora", "load", "sql-bot", "/srv/adapters/sql bot")
        unload = genq("adapters", "--queue", "genq-cli-lora", "unload", "sql-bot")
        bad = genq("adapters", "unload", "bad name")
        assert (load.returncode, unload.returncode) == (0, 0), load.stderr + unload.stderr
        assert "load of adapter sql-bot from /srv/adapters/sql bot sent to the workers of queue genq-cli-lora" in \
            load.stderr
        assert bad.returncode == 2 and "unload_adapter.name: must be 1 to 128 characters" in bad.stderr, bad.stderr
        published = [json.loads(wait_until(lambda: pubsub.get_message(timeout=1), 10, "a control message")["data"])
                     for _ in range(2)]
    finally:
        pubsub.close()
    assert published == [{"load_adapter": {"queue": "genq-cli-lora", "name": "sql-bot",
                                           "path": "/srv/adapters/sql bot"}},
                         {"unload_adapter": {"queue": "genq-cli-lora", "name": "sql-bot"}}]


def test_submit_for_an_adapter_the_worker_does_not_serve_exits_1_naming_it(genq):
    run = genq("submit", "Hello", "--adapter", "sql-bot", "--max-new-tokens", "4")
    assert run.returncode == 1 and "adapter 'sql-bot' is not registered (registered: none)" in run.stderr, run.stderr
