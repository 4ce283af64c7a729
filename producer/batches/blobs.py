"""Where the bytes of the Files API live (storage.py keeps their metadata in Redis): a `Blobs` is
a flat store of named byte strings, names like `file-<id>.jsonl` or `parts/<batch id>/<line>.json`.
Two kinds: a directory every gateway replica shares (`DirectoryBlobs`, here) and an S3-compatible
bucket (`S3Blobs`, s3_blobs.py, needing boto3: the `genq[s3]` extra). The methods block (disk or
HTTP); FileStore calls them in worker threads. A name is written whole or not at all, so a crash
never leaves half a file under it."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Protocol


class Blobs(Protocol):
    def put(self, name: str, data: bytes) -> None:
        """Store `data` under `name`, replacing what was there, atomically."""

    def get(self, name: str) -> bytes | None:
        """The bytes under `name`, None if there are none."""

    def get_many(self, names: list[str]) -> dict[str, bytes]:
        """The bytes of each of `names` that exists, in the order of `names`."""

    def names(self, folder: str) -> list[str]:
        """The names under `folder` (a prefix ending in '/')."""

    def delete(self, name: str) -> None:
        """Remove `name` if it exists."""

    def delete_folder(self, folder: str) -> None:
        """Remove every name under `folder` (a prefix ending in '/')."""


class DirectoryBlobs:
    """Names as paths under `directory`; a name is written to a temporary file and renamed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def put(self, name: str, data: bytes) -> None:
        path = self.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)

    def get(self, name: str) -> bytes | None:
        try:
            return (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None

    def get_many(self, names: list[str]) -> dict[str, bytes]:
        found = {name: self.get(name) for name in names}
        return {name: data for name, data in found.items() if data is not None}

    def names(self, folder: str) -> list[str]:
        try:
            entries = sorted((self.directory / folder).iterdir())
        except FileNotFoundError:
            return []
        return [folder + entry.name for entry in entries if entry.is_file() and not entry.name.startswith(".")]

    def delete(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)

    def delete_folder(self, folder: str) -> None:
        shutil.rmtree(self.directory / folder, ignore_errors=True)
