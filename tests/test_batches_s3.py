"""The Files and Batch APIs with their files in an S3-compatible bucket (issue 29): the `openai`
SDK's own calls against a real gateway (GENQ_GATEWAY_FILES_S3_*, credentials from the AWS
variables) and a real worker of the tiny model, the bucket a real S3 server process (moto's,
tests/s3_server.py); the two stores behind one interface, alike; retention deleting expired
files' bytes from either; a gateway given a bucket without boto3 refusing to start."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import openai
import pydantic
import pytest
import redis.asyncio

from producer.batches.blobs import Blobs, DirectoryBlobs
from producer.batches.owners import ADMIN
from producer.batches.s3_blobs import S3Blobs
from producer.batches.storage import FileStore
from producer.gateway.settings import GatewaySettings
from tests.gateway_service import TOKEN, GatewayProcess, service_env
from tests.s3_server import S3Server, s3_server
from tests.test_batches import ENDED, batch_env, chat_line, jsonl, wait_for
from worker.processes import ROOT, WorkerProcess

__all__ = ["s3_server"]

QUEUE = "genq-batch-s3"
PREFIX = "genq-test/"


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "batch-s3-worker")


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> S3Blobs:
    return s3_server.bucket(PREFIX)


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess], s3_server: S3Server,
            bucket: S3Blobs, tmp_path_factory: pytest.TempPathFactory) -> str:
    env = batch_env(tmp_path_factory.mktemp("unused"))
    del env["GENQ_GATEWAY_FILES_DIR"]
    return module_gateway(QUEUE, "batch-s3-gateway", **env, **s3_server.gateway_env(bucket)).url


def test_the_sdks_batch_keeps_its_files_in_the_bucket_and_deleting_them_empties_it(
        gateway: str, s3_server: S3Server, bucket: S3Blobs):
    oai = openai.OpenAI(base_url=f"{gateway}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    lines = [chat_line(f"s3-{i}", f"bucket line {i}") for i in range(6)]
    content = jsonl(lines)
    uploaded = oai.files.create(file=("bucket.jsonl", content), purpose="batch")
    input_key = f"{PREFIX}{uploaded.id}.jsonl"
    assert s3_server.objects(bucket) == {input_key: content}
    assert oai.files.content(uploaded.id).content == content

    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(oai, batch.id, ENDED)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 6, 0)
    assert done.output_file_id is not None and done.error_file_id is None
    output = oai.files.content(done.output_file_id).content
    answers = [json.loads(line) for line in output.splitlines()]
    assert [answer["custom_id"] for answer in answers] == [line["custom_id"] for line in lines]
    assert all(answer["response"]["status_code"] == 200 for answer in answers)
    output_key = f"{PREFIX}{done.output_file_id}.jsonl"
    # The per-line answers lived in the bucket too and went with the batch's end.
    assert s3_server.objects(bucket) == {input_key: content, output_key: output}

    assert oai.files.delete(uploaded.id).deleted
    assert s3_server.objects(bucket) == {output_key: output}
    # The gateway reads the bytes from the bucket: an object gone from it is a file gone.
    bucket.client.delete_object(Bucket=bucket.bucket, Key=output_key)
    with pytest.raises(openai.NotFoundError):
        oai.files.content(done.output_file_id)
    assert s3_server.objects(bucket) == {}


@pytest.fixture(params=["directory", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path, s3_server: S3Server) -> Blobs:
    return DirectoryBlobs(tmp_path / "files") if request.param == "directory" else s3_server.bucket("store/")


def test_both_stores_keep_replace_list_and_delete_names_alike(blobs: Blobs):
    assert blobs.get("a.jsonl") is None
    blobs.put("a.jsonl", b"one")
    blobs.put("a.jsonl", b"two")
    assert blobs.get("a.jsonl") == b"two"
    for index in (2, 0, 10):
        blobs.put(f"parts/b1/{index}.json", f"part {index}".encode())
    blobs.put("parts/b2/0.json", b"another batch")
    assert sorted(blobs.names("parts/b1/")) == ["parts/b1/0.json", "parts/b1/10.json", "parts/b1/2.json"]
    assert blobs.get_many(["parts/b1/10.json", "parts/b1/7.json", "parts/b1/0.json"]) == {
        "parts/b1/10.json": b"part 10", "parts/b1/0.json": b"part 0"}
    blobs.delete_folder("parts/b1/")
    assert blobs.names("parts/b1/") == []
    assert blobs.names("parts/b2/") == ["parts/b2/0.json"]
    blobs.delete("a.jsonl")
    blobs.delete("a.jsonl")  # twice, as two gateways sweeping at once may
    assert blobs.get("a.jsonl") is None


def test_a_file_past_its_retention_is_deleted_from_the_store_then_and_not_before(blobs: Blobs, redis_url: str):
    async def run() -> None:
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            store = FileStore(client, f"retain-{uuid.uuid4().hex[:8]}", blobs, retention_s=1)
            file = await store.create(b'{"x": 1}\n', "short.jsonl", "batch", ADMIN)
            await store.write_part("batch_x", 0, "output", {"custom_id": "a"})
            assert blobs.get(FileStore.blob_name(file.id)) == b'{"x": 1}\n'
            deadline = time.monotonic() + 30
            while True:  # polled: the sweep deletes what its clock says has expired
                swept_at = time.time()
                if await store.sweep():
                    break
                kept = await store.read(file.id, ADMIN)
                assert kept == b'{"x": 1}\n' or time.time() >= file.expires_at  # readable until it expires
                assert time.monotonic() < deadline, "the file was not swept within 30 s of its expiry"
                await asyncio.sleep(0.1)
            assert swept_at >= file.expires_at
            assert blobs.get(FileStore.blob_name(file.id)) is None
            assert await store.get(file.id, ADMIN) is None
            assert await store.read_parts("batch_x", 1) == [("output", {"custom_id": "a"})]
            await store.drop_parts("batch_x")
            assert await store.read_parts("batch_x", 1) == []
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_gateway_given_a_bucket_without_boto3_refuses_to_start_naming_the_setting(redis_url: str):
    code = ("import sys; sys.modules['boto3'] = None; from worker.cli import main; "
            "sys.exit(main(['gateway', '--port', '0']))")
    env = {**service_env(redis_url), "GENQ_GATEWAY_TOKEN": TOKEN, "GENQ_GATEWAY_FILES_S3_BUCKET": "genq-files"}
    started = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert started.returncode != 0
    assert "GENQ_GATEWAY_FILES_S3_BUCKET is set but boto3 is not installed" in started.stderr
    assert "genq[s3]" in started.stderr


def test_files_kept_in_a_directory_and_a_bucket_at_once_are_refused(tmp_path: Path):
    with pytest.raises(pydantic.ValidationError) as refused:
        GatewaySettings(token=TOKEN, files_dir=tmp_path, files_s3_bucket="genq-files")
    assert "GENQ_GATEWAY_FILES_DIR and GENQ_GATEWAY_FILES_S3_BUCKET are both set" in str(refused.value)


def test_the_gateway_imports_without_boto3():
    """boto3 is the s3 extra's: only s3_blobs.py imports it, and only a gateway given a bucket loads that."""
    code = ("import sys; sys.modules['boto3'] = None; import producer.gateway.app, producer.batches.storage; "
            "assert 'producer.batches.s3_blobs' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
