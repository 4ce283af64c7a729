"""The shape check every `genq.generate` message passes before Celery builds a
request from it.

Celery trusts a task message's shape: a body that is not protocol 2's
`[args, kwargs, embed]` or a missing `id` header raises inside its request
handling, where it either stops the worker or loops on the same message for
ever. This module names what is wrong with a message (as "field: problem",
like the protocol's own errors) so the consumer can refuse it instead; it
reads nothing but the message and imports nothing that talks to Redis.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.utils.time import maybe_iso8601
from kombu.exceptions import ContentDisallowed

from producer.protocol import IDENTIFIER_RE

MAX_TASK_ID_CHARS = 256
#: Headers Celery's request handling reads, and the JSON types it can cope with.
HEADER_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("task", "shadow", "eta", "expires", "root_id", "parent_id", "group", "argsrepr", "kwargsrepr",
                     "origin", "lang"), (str,)),
    "retries": (int,),
    "ignore_result": (bool,),
    "timelimit": (list, tuple),
}
EMBED_KEYS = ("callbacks", "errbacks", "chain", "chord")


@dataclass(frozen=True)
class Refusal:
    """Why a message is refused, and where the producer can be told: the task
    id (its stored result) and the stream identifier, when they can be read
    and are safe to name Redis keys with (IDENTIFIER_PATTERN)."""

    reason: str
    task_id: str | None
    identifier: str | None


def check_message(message: Any) -> Refusal | None:
    """None when the message is a well-formed protocol 2 `genq.generate` task."""
    headers = message.headers if isinstance(message.headers, Mapping) else {}
    task_id = _task_id(headers)
    body: Any = None
    body_problem: str | None
    try:
        body = message.decode()
    except ContentDisallowed:
        body_problem = f"content_type: {message.content_type!r} is not accepted; send JSON (application/json)"
    except Exception as error:  # noqa: BLE001 - any undecodable body is the producer's error
        body_problem = f"body: cannot be decoded as {message.content_type!r} ({type(error).__name__}: {error})"
    else:
        body_problem = _body_problem(body)
    problem = _header_problem(headers, task_id) or body_problem
    if problem is None:
        return None
    kwargs = body[1] if isinstance(body, list | tuple) and len(body) == 3 and isinstance(body[1], Mapping) else {}
    # A result is stored under the task id, and an error published under the identifier (else the
    # task id), only when it is safe to name a Redis key with.
    storable = task_id if task_id is not None and IDENTIFIER_RE.fullmatch(task_id) else None
    requested = kwargs.get("identifier")
    identifier = requested if isinstance(requested, str) and IDENTIFIER_RE.fullmatch(requested) else storable
    return Refusal(_shorten(problem), storable, identifier)


def _task_id(headers: Mapping[str, Any]) -> str | None:
    value = headers.get("id")
    return value if isinstance(value, str) and 0 < len(value) <= MAX_TASK_ID_CHARS else None


def _header_problem(headers: Mapping[str, Any], task_id: str | None) -> str | None:
    if task_id is None:
        return f"id: the task id header must be a string of 1 to {MAX_TASK_ID_CHARS} characters"
    for name, types in HEADER_TYPES.items():
        value = headers.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
            return f"{name}: header of type {type(value).__name__} not allowed here"
    for name in ("eta", "expires"):
        try:
            maybe_iso8601(headers.get(name))
        except (AttributeError, TypeError, ValueError):
            return f"{name}: header must be an ISO 8601 date, got {headers.get(name)!r:.80}"
    limits = headers.get("timelimit")
    if limits is not None and (
        len(limits) != 2 or not all(v is None or isinstance(v, int | float) and not isinstance(v, bool)
                                    for v in limits)
    ):
        return "timelimit: header must be [hard seconds or null, soft seconds or null]"
    return None


def _body_problem(body: Any) -> str | None:
    if not isinstance(body, list | tuple) or len(body) != 3:
        return f"body: must be protocol 2's [args, kwargs, embed], got {_describe(body)}"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple):
        return f"args: must be a list, got {_describe(args)}"
    if not isinstance(kwargs, Mapping):
        return f"kwargs: must be an object of keyword arguments, got {_describe(kwargs)}"
    if "self" in kwargs:
        # Celery's own call signature takes `self`: such a task could never reach the request's validation.
        return "self: unknown field"
    if embed is not None and not isinstance(embed, Mapping):
        return f"embed: must be an object or null, got {_describe(embed)}"
    for key in EMBED_KEYS:
        linked = (embed or {}).get(key)
        signatures = [linked] if key == "chord" else linked
        if linked is not None and not (isinstance(signatures, list)
                                       and all(isinstance(s, Mapping) and isinstance(s.get("task"), str)
                                               for s in signatures)):
            expected = "a task signature" if key == "chord" else "a list of task signatures"
            return f"embed.{key}: must be null or {expected}"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"an array of {len(value)}"
    names = {dict: "an object", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def _shorten(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + "..."

