"""What every endpoint that queues work shares: the adapter a routed `model` names, a request's
fields parsed into a GenerationRequest with OpenAI-named refusals, and a task's events read for a
stream that cannot be resumed."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any

from producer.client import AsyncGenerationHandle, EventKey
from producer.gateway.constraints import ConstraintChecker
from producer.gateway.errors import ApiError
from producer.gateway.model_router import Target
from producer.gateway.openai_api import openai_problem
from producer.gateway.subscriptions import FellBehind
from producer.protocol import GenerationRequest, ProtocolError, StreamEvent


def routed(fields: dict[str, Any], target: Target) -> dict[str, Any]:
    """An OpenAI request's fields with the adapter its `model` names (none for a base model)."""
    return fields if target.route.adapter is None else {**fields, "adapter": target.route.adapter}


async def parse_request(constraints: ConstraintChecker, fields: dict[str, Any], *, status: int,
                        names: Mapping[str, str] | None = None) -> GenerationRequest:
    """The request, or an ApiError whose param is the first problem's field; with `names` (an
    OpenAI request's), each problem is named by the parameter the caller sent. The constraint is
    checked off the event loop (producer/gateway/constraints.py)."""
    try:
        request = GenerationRequest.parse_payload(fields)
    except ProtocolError as error:
        problems = [openai_problem(p, names) for p in error.problems] if names is not None else error.problems
        param = problems[0].split(":", 1)[0] if problems else None
        raise ApiError(status, "invalid_request", "\n".join(problems), param=param, problems=problems) from None
    problem = await constraints.problem(request.constraint) if request.constraint is not None else None
    if problem is not None:
        param = (names or {}).get("constraint", "constraint")
        raise ApiError(status, "invalid_constraint", problem, param=param, problems=[problem])
    return request


async def resuming(handle: AsyncGenerationHandle, timeout_s: float) -> AsyncGenerator[StreamEvent, None]:
    """The task's events for a stream its client cannot resume (OpenAI's has no Last-Event-ID): a
    reader that fell behind reads on from the replay stream, where it was."""
    after: EventKey | None = None
    while True:
        try:
            async with aclosing(handle.events(timeout=timeout_s, after=after)) as events:
                async for event in events:
                    after = (event.attempt, event.seq)
                    yield event
            return
        except FellBehind:
            pass  # read on: the next round replays what was dropped
