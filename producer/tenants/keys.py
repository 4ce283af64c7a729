"""API keys: created, listed, rotated and revoked by `genq keys` (sync Redis), looked up by the
gateway on every request (async Redis; no local cache, so a revoked or rotated key is refused by
every gateway process at its next request).

A key reads `gk_<id>.<secret>`: the id finds its record in one HGETALL, the secret (32 random
bytes, URL-safe base64) is checked against the record's SHA-256 of the whole key. Only the hash is
stored, and the key is shown once, when created or rotated. A slow KDF (bcrypt, scrypt) protects
low-entropy passwords from guessing; a 256-bit random secret cannot be guessed, and a plain hash
keeps the per-request check at microseconds.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import redis
import redis.asyncio

from producer.protocol import IDENTIFIER_RE, MAX_PRIORITY, MIN_PRIORITY
from producer.tenants.names import api_key_index, api_key_record, decoded

KEY_MARK = "gk_"
ID_BYTES = 8
SECRET_BYTES = 32
_KEY_RE = re.compile(r"gk_([0-9a-f]{16})\.([A-Za-z0-9_-]{43})")


class KeyProblem(ValueError):
    """A key operation that cannot be done (unknown id, a limit out of range); the message says why."""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """What one key may use; None: unlimited. Limits are per key: a tenant with several keys gets
    each key's limits (docs/gateway.md)."""

    rpm: int | None = None
    tpm: int | None = None
    concurrent: int | None = None
    max_priority: int | None = None
    """The best (lowest) priority the key's requests get; a better one asked for is clamped to it."""

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "concurrent"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise KeyProblem(f"{name}: must be at least 1 (leave it out for no limit), got {value}")
        if self.max_priority is not None and not MIN_PRIORITY <= self.max_priority <= MAX_PRIORITY:
            raise KeyProblem(f"max_priority: must lie in [{MIN_PRIORITY}, {MAX_PRIORITY}] (0 is served first), "
                             f"got {self.max_priority}")


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    tenant: str
    name: str
    created: int
    revoked: bool
    limits: KeyLimits
    digest: str

    def to_public(self) -> dict[str, object]:
        """The record as `genq keys list` shows it (never the digest)."""
        return {"id": self.id, "tenant": self.tenant, "name": self.name, "created": self.created,
                "revoked": self.revoked, **asdict(self.limits)}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key: str) -> str | None:
    """The id a well-formed key names, else None."""
    match = _KEY_RE.fullmatch(key)
    return match[1] if match else None


def _new_key(identifier: str) -> str:
    return f"{KEY_MARK}{identifier}.{secrets.token_urlsafe(SECRET_BYTES)}"


def _fields(key: ApiKey) -> list[str]:
    """The record as HSET's flat field, value list."""
    limits = {name: "" if value is None else str(value) for name, value in asdict(key.limits).items()}
    fields = {"id": key.id, "tenant": key.tenant, "name": key.name, "created": str(key.created),
              "revoked": "1" if key.revoked else "0", "digest": key.digest, **limits}
    return [item for pair in fields.items() for item in pair]


def _parse(raw: Mapping[bytes | str, bytes | str]) -> ApiKey | None:
    fields = {decoded(k): decoded(v) for k, v in raw.items()}
    if "id" not in fields:
        return None
    limits = KeyLimits(**{name: int(fields[name]) if fields.get(name) else None
                          for name in ("rpm", "tpm", "concurrent", "max_priority")})
    return ApiKey(fields["id"], fields["tenant"], fields["name"], int(fields["created"]), fields["revoked"] == "1",
                  limits, fields["digest"])


class KeyStore:
    """The operator's side (`genq keys`): sync Redis."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def create(self, tenant: str, name: str, limits: KeyLimits) -> tuple[ApiKey, str]:
        """A new key of `tenant`: its record and the key itself (shown once)."""
        if not IDENTIFIER_RE.fullmatch(tenant):
            raise KeyProblem(f"tenant: must follow the identifier rule (letters, digits, '_.:-', at most 128), "
                            f"got {tenant!r}")
        identifier = secrets.token_hex(ID_BYTES)
        secret = _new_key(identifier)
        record = ApiKey(identifier, tenant, name, int(time.time()), False, limits, digest(secret))
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(api_key_record(self.prefix, identifier), items=_fields(record))
        pipe.sadd(api_key_index(self.prefix), identifier)
        pipe.execute()
        return record, secret

    def get(self, identifier: str) -> ApiKey:
        record = _parse(self.client.hgetall(api_key_record(self.prefix, identifier)))
        if record is None:
            raise KeyProblem(f"no API key with id {identifier!r} (`genq keys list` shows them)")
        return record

    def list(self) -> list[ApiKey]:
        ids = sorted(decoded(i) for i in self.client.smembers(api_key_index(self.prefix)))
        return [self.get(identifier) for identifier in ids]

    def rotate(self, identifier: str) -> tuple[ApiKey, str]:
        """A new secret for the key (same id, tenant, limits and usage); the old one stops working at once."""
        record = self.get(identifier)
        if record.revoked:
            raise KeyProblem(f"API key {identifier} is revoked; create a new one")
        secret = _new_key(identifier)
        record = replace(record, digest=digest(secret))
        self.client.hset(api_key_record(self.prefix, identifier), "digest", record.digest)
        return record, secret

    def revoke(self, identifier: str) -> ApiKey:
        """Refused from the next request on, by every gateway; the record stays for its usage."""
        self.get(identifier)
        self.client.hset(api_key_record(self.prefix, identifier), "revoked", "1")
        return self.get(identifier)


async def lookup(client: redis.asyncio.Redis, prefix: str, key: str) -> ApiKey | None:
    """The live (unrevoked) key `key` is, or None: one HGETALL, a constant-time digest compare."""
    identifier = key_id(key)
    if identifier is None:
        return None
    record = _parse(await client.hgetall(api_key_record(prefix, identifier)))
    if record is None or record.revoked or not hmac.compare_digest(record.digest, digest(key)):
        return None
    return record
