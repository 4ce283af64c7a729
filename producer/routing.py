"""Prefix-aware routing (opt-in): requests that start alike go to one worker.

A worker's prefix cache only helps requests that reach that worker. On a
shared queue, requests with the same long system prompt spread over all the
workers, and each computes the prefix once per worker at best, and again
whenever its cache evicted it. With GENQ_PREFIX_ROUTES=N the producer hashes
the start of each request (its first GENQ_PREFIX_ROUTE_CHARS characters of
prompt text, chat messages or token ids; 256 by default) into one of N routes
and sends it to the queue `{queue}.route{i}`; each worker consumes the shared
queue plus the routes given by GENQ_PREFIX_ROUTE (e.g. `0` or `0,1`). Keep
the hashed start no longer than the part requests share (the system prompt):
requests that differ within it are spread like unrouted ones.

Chained genq tasks, and callbacks sent from a genq worker, are routed there
by task_router: only `genq.generate` goes to a genq queue; any other task (a
user's own callback) keeps its own routes or Celery's default queue, where
the user's workers look, instead of landing on a queue no worker of it reads.

Every route needs a worker consuming it, or its requests wait for one: run
one worker per route (with a restart policy), or give each route to two
workers for redundancy at some cost in hit rate. The hash is SHA-256, not
Python's hash(), so every producer process agrees on the routes.

Tenant lanes (opt-in, GENQ_TENANT_LANES=N; docs/protocol.md, Fair share): a
request naming a tenant goes to the lane `{queue}.lane{j}` of the queue chosen
above, j the SHA-256 of the tenant modulo N; a request without a tenant stays
on the queue itself. Workers consume the queue and all its lanes, and switch
kombu's Redis transport to its round-robin queue cycle: after each delivery
the list it came from moves to the end of the BRPOP key order, so a free task
slot goes to the next lane with work, and one tenant's backlog no longer
stands in front of another's. Priorities still come first: kombu lists every
queue's priority-0 keys before any queue's priority-1 keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from producer.protocol import TASK_NAME

ROUTE_SEPARATOR = ".route"
MAX_PREFIX_ROUTES = 1024
LANE_SEPARATOR = ".lane"
MAX_TENANT_LANES = 64
"""Every BRPOP lists each lane's ten priority keys: 64 lanes make 650 keys per served queue."""


def route_queue(queue: str, route: int) -> str:
    return f"{queue}{ROUTE_SEPARATOR}{route}"


def lane_queue(queue: str, lane: int) -> str:
    return f"{queue}{LANE_SEPARATOR}{lane}"


def tenant_queue(queue: str, tenant: str | None, lanes: int) -> str:
    """The list a tenant's requests for `queue` go to: its lane with lanes on, else the queue itself.
    The gateway and the clients route through this (via ClientSettings.queue_for)."""
    if not lanes or tenant is None:
        return queue
    digest = hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).digest()
    return lane_queue(queue, int.from_bytes(digest[:8], "big") % lanes)


def with_lanes(queues: list[str], lanes: int) -> list[str]:
    """Every list the given queues spread over: each queue, then its lanes. What a worker consumes,
    and what a queue's depth must count."""
    return [name for queue in queues for name in (queue, *(lane_queue(queue, lane) for lane in range(lanes)))]


def request_prefix(kwargs: Mapping[str, Any], chars: int) -> str:
    """The start of a request as text: its prompt, its chat messages (role and
    content), or its token ids, cut at `chars` characters."""
    if kwargs.get("messages"):
        text = "".join(f"{m.get('role', '')}\x1f{m.get('content', '')}\x1e" for m in kwargs["messages"])
    elif kwargs.get("prompt") is not None:
        text = str(kwargs["prompt"])
    else:
        text = ",".join(str(token) for token in kwargs.get("input_ids") or [])
    return text[:chars]


def prefix_route(kwargs: Mapping[str, Any], routes: int, chars: int) -> int:
    """Which of `routes` routes a request goes to: the same for the same first `chars` characters."""
    digest = hashlib.sha256(request_prefix(kwargs, chars).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % routes


def task_router(queue_for: Callable[[Mapping[str, Any]], str]) -> Callable[..., dict[str, str] | None]:
    """A Celery router (task_routes) that sends `genq.generate` to `queue_for(kwargs)` and has
    no say on any other task."""

    def route(name: str, args: Any, kwargs: Mapping[str, Any] | None, options: Any, task: Any = None,
              **_: Any) -> dict[str, str] | None:
        if name != TASK_NAME:
            return None
        return {"queue": queue_for(kwargs if isinstance(kwargs, Mapping) else {})}

    return route
