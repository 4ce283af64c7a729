"""Task records: which identifiers the gateway has given out, and the nonce each task's access
token is bound to.

A webhook sender chooses its task's identifier, so neither "is this id free?" nor "who may read
this task?" can be answered from the id alone. When the gateway accepts a task it writes
`{prefix}:task:{id}` = a random nonce, with SET NX and an expiry equal to the result's lifetime
(GENQ_RESULT_EXPIRES_S):

- NX makes the claim atomic across gateway replicas: while the record lives, another request
  with the same identifier is refused with 409, whoever sends it. An identifier that the
  service already knows without a record (a worker has started it: its attempt counter, replay
  stream or Celery state exists; a task sent straight to Celery) is refused the same way.
- A task created with an API key also has an owner, `names.task_tenant`, written by its
  admission (producer/tenants/admission.py) for every endpoint alike: the tenant whose keys may
  read and cancel it (producer/gateway/auth.py).
- The task's access token is HMAC(webhook secret, id + nonce) (producer.signing): it cannot be
  computed without the nonce, which only the 202 answer reveals (as part of the token) and only
  Redis keeps, and it stops working when the record expires.
"""

from __future__ import annotations

import secrets

import redis.asyncio
from celery import states

from producer.client import AsyncGenqClient
from producer.gateway.errors import ApiError
from producer.protocol import attempt_key, stream_key
from producer.tenants.names import decoded, task_tenant

NONCE_BYTES = 16
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def task_record_key(identifier: str, prefix: str) -> str:
    return f"{prefix}:task:{identifier}"


class TaskRecords:
    """The gateway's claims on identifiers, in the streams' Redis."""

    def __init__(self, client: AsyncGenqClient, prefix: str, ttl_s: int) -> None:
        self.client = client
        self.redis: redis.asyncio.Redis = client.redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._release = self.redis.register_script(_RELEASE)

    def _taken(self, identifier: str) -> ApiError:
        return ApiError(409, "identifier_in_use",
                        f"identifier: {identifier!r} is already used by another task (queued, running, or "
                        f"finished less than {self.ttl_s} s ago); send a fresh identifier, e.g. a UUID",
                        param="identifier")

    async def claim(self, identifier: str) -> str:
        """Take `identifier` for a new task; returns the task's nonce. ApiError 409 if taken."""
        nonce = secrets.token_hex(NONCE_BYTES)
        if not await self.redis.set(task_record_key(identifier, self.prefix), nonce, nx=True, ex=self.ttl_s):
            raise self._taken(identifier)
        if await self._known_to_the_service(identifier):
            await self.release(identifier, nonce)
            raise self._taken(identifier)
        return nonce

    async def release(self, identifier: str, nonce: str) -> None:
        """Give the identifier back (the task was not enqueued), unless someone else holds it now."""
        await self._release(keys=[task_record_key(identifier, self.prefix)], args=[nonce])

    async def nonce(self, identifier: str) -> str | None:
        value = await self.redis.get(task_record_key(identifier, self.prefix))
        return value.decode() if isinstance(value, bytes) else value

    async def owner(self, identifier: str) -> str | None:
        """The tenant whose API key created the task; None for the admin's tasks and unknown ones."""
        value = await self.redis.get(task_tenant(self.prefix, identifier))
        return None if value is None else decoded(value)

    async def _known_to_the_service(self, identifier: str) -> bool:
        """Traces of a task this gateway did not accept: a worker started it (attempt counter,
        replay stream) or Celery has a state for it."""
        if await self.redis.exists(attempt_key(identifier, self.prefix), stream_key(identifier, self.prefix)):
            return True
        return await self.client.handle(identifier).state() != states.PENDING
