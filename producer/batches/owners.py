"""Whose files and batches they are. A file or batch an API key makes belongs to the key's tenant;
one the admin makes (the gateway token) belongs to no tenant. A key sees only its tenant's; the
admin sees every one. A batch also keeps the `max_priority` of the key that made it, the best
priority its lines may run at, and the key's id, under which its lines' usage counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis.asyncio


@dataclass(frozen=True, slots=True)
class Owner:
    """A caller, or the maker of a file or batch: an API key's tenant (and that key's
    max_priority and id), or the admin (tenant None)."""

    tenant: str | None = None
    max_priority: int | None = None
    key_id: str | None = None

    def sees(self, tenant: str | None) -> bool:
        """Whether this caller may see a file or batch that `tenant` owns (None: the admin's)."""
        return self.tenant is None or self.tenant == tenant

    def listing(self, stem: str) -> str:
        """The sorted set that lists what this caller sees: the stem itself (everything) for the
        admin, the tenant's own under it for a key."""
        return stem if self.tenant is None else f"{stem}:tenant:{self.tenant}"


ADMIN = Owner()


async def page_start(client: redis.asyncio.Redis, listing: str, after: str | None) -> int:
    """Where a newest-first page of `listing` starts: just past the id `after` (the OpenAI list's
    cursor), or at the top without one or when `after` is no longer listed."""
    if after is None:
        return 0
    rank = cast(int | None, await client.zrevrank(listing, after))
    return 0 if rank is None else rank + 1
