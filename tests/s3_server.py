"""An S3-compatible server for the tests of the Files API's bucket storage: moto's server
(`python -m moto.server`), a process of its own speaking S3's HTTP API on a free port, reached
with boto3 like any S3 endpoint. Its credentials are any (it checks none); the gateway gets them
from the standard AWS variables, as in a deployment."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import boto3
import httpx
import pytest

from producer.batches.s3_blobs import S3Blobs
from worker.processes import ChildProcess, free_port

REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "genq-test", "AWS_SECRET_ACCESS_KEY": "genq-test-secret",
               "AWS_DEFAULT_REGION": REGION}


class S3Server(ChildProcess):
    def __init__(self, log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        super().__init__("s3 server", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         log_path, {**os.environ, **CREDENTIALS})

    def start(self) -> Self:
        return self.start_until(self.up, 30, "the S3 server to answer")

    def up(self) -> bool:
        self.check_alive()
        try:
            httpx.get(self.url, timeout=2)
        except httpx.TransportError:
            return False
        return True

    def bucket(self, prefix: str = "") -> S3Blobs:
        """A new bucket's blobs under `prefix` (a client with the credentials given, not from the
        environment, which the gateway's `connect` reads)."""
        client = boto3.session.Session(aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                       aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                       region_name=REGION).client("s3", endpoint_url=self.url)
        blobs = S3Blobs(client, f"genq-{uuid.uuid4().hex[:12]}", prefix)
        client.create_bucket(Bucket=blobs.bucket)
        return blobs

    def objects(self, blobs: S3Blobs) -> dict[str, bytes]:
        """Every object of the bucket (whatever its prefix) and its bytes."""
        pages = blobs.client.get_paginator("list_objects_v2").paginate(Bucket=blobs.bucket)
        keys: list[Any] = [entry["Key"] for page in pages for entry in page.get("Contents", ())]
        return {key: blobs.client.get_object(Bucket=blobs.bucket, Key=key)["Body"].read() for key in keys}

    def gateway_env(self, blobs: S3Blobs) -> dict[str, str]:
        """A gateway's settings keeping its files in `blobs`' bucket, credentials as AWS's variables."""
        return {"GENQ_GATEWAY_FILES_S3_BUCKET": blobs.bucket, "GENQ_GATEWAY_FILES_S3_PREFIX": blobs.prefix,
                "GENQ_GATEWAY_FILES_S3_ENDPOINT_URL": self.url, "GENQ_GATEWAY_FILES_S3_REGION": REGION,
                **CREDENTIALS}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server(tmp_path_factory.mktemp("s3") / "s3.log") as server:
        yield server
