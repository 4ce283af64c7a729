"""The Files API's bytes in an S3-compatible bucket (AWS S3, MinIO, Ceph, R2, ...), for gateway
replicas that share no directory: `Blobs` (blobs.py) over boto3, which only this module imports
(the `genq[s3]` extra). A name is stored as the object `<prefix><name>`; PUT replaces an object
whole, so a reader never sees half a file. Credentials come from boto3's own chain
(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, an instance role),
never from genq's settings. Checksums are sent only where S3 requires them (boto3's default since
1.36 sends them on every upload, which several S3-compatible servers refuse)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

PARALLEL_REQUESTS = 16
"""Objects fetched at once by `get_many` (a batch's per-line answers); also the client's pool size."""
DELETE_PAGE = 1000
"""S3's most keys in one DeleteObjects."""
_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Blobs:
    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def put(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data)

    def get(self, name: str) -> bytes | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise
        data: bytes = answer["Body"].read()
        return data

    def get_many(self, names: list[str]) -> dict[str, bytes]:
        with ThreadPoolExecutor(PARALLEL_REQUESTS, thread_name_prefix="s3-get") as pool:
            found = dict(zip(names, pool.map(self.get, names), strict=True))
        return {name: data for name, data in found.items() if data is not None}

    def names(self, folder: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + folder)
        return [entry["Key"][len(self.prefix):] for page in pages for entry in page.get("Contents", ())]

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)

    def delete_folder(self, folder: str) -> None:
        names = self.names(folder)
        for start in range(0, len(names), DELETE_PAGE):
            keys = [{"Key": self.prefix + name} for name in names[start:start + DELETE_PAGE]]
            answer = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            if answer.get("Errors"):
                failed = answer["Errors"][0]
                raise OSError(f"S3 refused to delete {len(answer['Errors'])} objects of {folder!r}, e.g. "
                              f"{failed.get('Key')}: {failed.get('Code')} {failed.get('Message')}")


def connect(bucket: str, prefix: str, endpoint_url: str | None, region: str | None) -> S3Blobs:
    """A bucket's blobs through a client of its own session (boto3's default session is not
    thread-safe to create clients from)."""
    config = Config(max_pool_connections=PARALLEL_REQUESTS, retries={"mode": "standard"},
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
    return S3Blobs(client, bucket, prefix)
