"""Who may call the gateway.

- `Authorization: Bearer <GENQ_GATEWAY_TOKEN>`: every endpoint (the OpenAI SDKs send their
  api_key this way).
- A webhook signature (producer.signing, key GENQ_WEBHOOK_SECRET): `POST /v1/tasks` only. The
  timestamp must lie within GENQ_GATEWAY_REPLAY_WINDOW_S of the gateway's clock, and each
  signature is accepted once: its digest is stored in Redis with SET NX EX for twice the window
  (a signature can only be valid during the window around its timestamp, so that covers it).
  The digest is claimed before the request is processed (two copies racing cannot both pass)
  and given back when the request is refused (422, 409, 429, ...), so that the sender's retry
  with the same signed bytes is judged anew: only an accepted request uses its signature up.
- The task's access token from the 202 answer (HMAC of the id and of the random nonce the
  gateway stored with the task, producer.gateway.access), as a bearer token or an
  `access_token` query parameter: that task's status, events and cancel, until its record
  expires.
- Nothing, when GENQ_GATEWAY_ALLOW_ANONYMOUS=true.
- An API key (`genq keys create`; producer/tenants/keys.py) as the bearer token: every endpoint
  but as its tenant: its requests run as that tenant (any `tenant` in the body is replaced)
  within the key's limits (producer/gateway/tenancy.py), and it sees only its tenant's tasks:
  another tenant's task answers 404, as an unknown one does, so ids do not leak. The key's record
  is read from Redis on every request (no cache): a revoked or rotated key is refused by every
  gateway process from its next request on.

The gateway token, a signature and anonymous access are the admin: no limits, every tenant.

Status codes: 401 for missing or wrong credentials, a bad signature or a timestamp outside the
window; 409 for a replayed signature (the request was authentic and has already been accepted,
so a sender retrying after a lost answer learns that its first try went through).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import redis.asyncio
from fastapi import Request

from producer.gateway.access import TaskRecords
from producer.gateway.errors import ApiError
from producer.gateway.settings import GatewaySettings
from producer.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, task_access_token, verify
from producer.tenants.keys import ApiKey, lookup

_SIGNATURE_CODES = {"missing": "missing_signature", "malformed": "invalid_signature",
                    "mismatch": "invalid_signature", "stale": "stale_timestamp"}


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent the request: an API key, or the admin (key None)."""

    key: ApiKey | None = None


ADMIN = Caller()


def caller_of(request: Request) -> Caller:
    """The caller the authentication of this request found (the admin where none ran)."""
    caller = getattr(request.state, "caller", ADMIN)
    assert isinstance(caller, Caller)
    return caller


def _bearer(request: Request) -> str | None:
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def has_gateway_token(settings: GatewaySettings, request: Request) -> bool:
    return settings.allow_anonymous or (
        settings.token is not None and _matches(_bearer(request), settings.token.get_secret_value()))


async def _api_key(request: Request, client: redis.asyncio.Redis, prefix: str) -> ApiKey | None:
    """The live API key the bearer token is, remembered as the request's caller."""
    bearer = _bearer(request)
    key = None if bearer is None else await lookup(client, prefix, bearer)
    if key is not None:
        request.state.caller = Caller(key)
    return key


async def require_gateway_token(settings: GatewaySettings, request: Request, client: redis.asyncio.Redis) -> None:
    """The OpenAI endpoints: the bearer token or an API key (there is no body signature in
    OpenAI's protocol)."""
    if has_gateway_token(settings, request) or await _api_key(request, client, settings.key_prefix):
        return
    if settings.token is None and _bearer(request) is None:
        raise ApiError(401, "invalid_api_key", "this endpoint needs an API key or GENQ_GATEWAY_TOKEN (configured "
                                               "on the gateway), sent as 'Authorization: Bearer <token>'")
    raise ApiError(401, "invalid_api_key", "missing, wrong or revoked bearer token or API key "
                                           "('Authorization: Bearer <token>')")


async def require_task_access(settings: GatewaySettings, request: Request, identifier: str,
                              records: TaskRecords) -> None:
    """Status, events and cancel of one task: the gateway token, an API key of the task's tenant
    (another tenant's: 404), or that task's access token."""
    if has_gateway_token(settings, request):
        return
    if (key := await _api_key(request, records.redis, settings.key_prefix)) is not None:
        if await records.owner(identifier) != key.tenant:
            raise ApiError(404, "task_not_found", f"no task {identifier!r} of tenant {key.tenant!r}")
        return
    offered = [token for token in (_bearer(request), request.query_params.get("access_token")) if token]
    if settings.webhook_secret is not None and offered and (nonce := await records.nonce(identifier)) is not None:
        expected = task_access_token(settings.webhook_secret.get_secret_value(), identifier, nonce)
        if any(_matches(token, expected) for token in offered):
            return
    raise ApiError(401, "invalid_api_key", "send the gateway token or this task's access token "
                                           "('Authorization: Bearer <token>' or ?access_token=<token>)")


async def require_webhook_auth(settings: GatewaySettings, request: Request, body: bytes,
                               replay_store: redis.asyncio.Redis) -> str | None:
    """`POST /v1/tasks`: the bearer token, or a fresh signature of this body never accepted before.
    Returns the Redis key that now marks the signature as used (None for the bearer token): the
    caller deletes it with `forget_signature` if it refuses the request after all."""
    if has_gateway_token(settings, request) or await _api_key(request, replay_store, settings.key_prefix):
        return None
    if settings.webhook_secret is None:
        raise ApiError(401, "invalid_api_key", "missing or wrong bearer token ('Authorization: Bearer <token>')")
    try:
        digest = verify(settings.webhook_secret.get_secret_value(), body, request.headers.get(TIMESTAMP_HEADER),
                        request.headers.get(SIGNATURE_HEADER), window_s=settings.replay_window_s)
    except SignatureError as error:
        raise ApiError(401, _SIGNATURE_CODES[error.problem], str(error)) from None
    key = f"{settings.key_prefix}:webhook:seen:{digest}"
    if not await replay_store.set(key, "1", nx=True, ex=2 * settings.replay_window_s):
        raise ApiError(409, "replayed_request", "this signed request was already accepted; sign each request anew "
                                                "(a new timestamp gives a new signature)")
    return key


async def forget_signature(replay_store: redis.asyncio.Redis, key: str) -> None:
    await replay_store.delete(key)
