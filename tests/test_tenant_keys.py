"""`genq keys` (issue 29): a key is shown once and stored only as its SHA-256; list never shows
it; rotate and revoke change what the gateway's lookup accepts at once; bad limits are refused
naming the option."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess

import redis
import redis.asyncio

from producer.protocol import DEFAULT_KEY_PREFIX
from producer.tenants.keys import ApiKey, KeyLimits, lookup
from producer.tenants.names import api_key_record
from worker.processes import genq_command


def genq_keys(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(genq_command("keys", *args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GENQ_REDIS_URL": redis_url})


def found(redis_url: str, key: str) -> ApiKey | None:
    async def look() -> ApiKey | None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await lookup(client, DEFAULT_KEY_PREFIX, key)
        finally:
            await client.aclose()

    return asyncio.run(look())


def test_a_key_is_shown_once_stored_hashed_and_rotated_and_revoked_at_once(redis_url: str,
                                                                            redis_client: redis.Redis):
    created = genq_keys(redis_url, "create", "--tenant", "acme", "--name", "ci", "--rpm", "5", "--tpm", "1000",
                        "--concurrent", "2", "--max-priority", "3")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    record = found(redis_url, key)
    assert record is not None and record.tenant == "acme"
    assert record.limits == KeyLimits(rpm=5, tpm=1000, concurrent=2, max_priority=3)
    stored = redis_client.hgetall(api_key_record(DEFAULT_KEY_PREFIX, record.id))
    assert stored[b"digest"].decode() == hashlib.sha256(key.encode()).hexdigest()
    assert key.encode() not in b"".join(list(stored.values()))

    listed = [json.loads(line) for line in genq_keys(redis_url, "list").stdout.splitlines()]
    mine = [entry for entry in listed if entry["id"] == record.id]
    assert mine == [{"id": record.id, "tenant": "acme", "name": "ci", "created": record.created, "revoked": False,
                     "rpm": 5, "tpm": 1000, "concurrent": 2, "max_priority": 3}]

    rotated = genq_keys(redis_url, "rotate", record.id)
    assert rotated.returncode == 0, rotated.stderr
    new_key = rotated.stdout.strip()
    assert new_key != key
    assert found(redis_url, key) is None
    assert found(redis_url, new_key) is not None

    revoked = genq_keys(redis_url, "revoke", record.id)
    assert revoked.returncode == 0, revoked.stderr
    assert found(redis_url, new_key) is None
    assert genq_keys(redis_url, "rotate", record.id).returncode == 2


def test_bad_limits_and_unknown_ids_are_refused_naming_them(redis_url: str):
    zero = genq_keys(redis_url, "create", "--tenant", "acme", "--rpm", "0")
    assert zero.returncode == 2 and "rpm: must be at least 1" in zero.stderr
    priority = genq_keys(redis_url, "create", "--tenant", "acme", "--max-priority", "12")
    assert priority.returncode == 2 and "max_priority: must lie in [0, 9]" in priority.stderr
    tenant = genq_keys(redis_url, "create", "--tenant", "no spaces")
    assert tenant.returncode == 2 and "tenant: must follow the identifier rule" in tenant.stderr
    unknown = genq_keys(redis_url, "revoke", "0123456789abcdef")
    assert unknown.returncode == 2 and "no API key with id '0123456789abcdef'" in unknown.stderr


def test_keys_help_explains_the_limits():
    shown = subprocess.run(genq_command("keys", "create", "--help"), capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    for option in ("--rpm", "--tpm", "--concurrent", "--max-priority", "--tenant"):
        assert option in shown.stdout
    assert "clamped" in shown.stdout
