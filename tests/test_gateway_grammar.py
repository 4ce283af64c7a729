"""A grammar must not freeze the gateway (issue 23, items 3 and 5), against a real `genq gateway`:
while four hostile grammars (GBNF whose conversion takes seconds) are checked, /healthz answers
promptly; a constraint over the check's time or size budget is a 400 naming the limit; the same
grammar again is answered from the cache; a grammar past one of llguidance's limits is a 400 of
one line naming it. No worker is needed: every request here is refused before it is queued."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from grammar_limits import MAX_ERROR_CHARS
from tests.gateway_service import MODEL, GatewayProcess, bearer

QUEUE = "genq-gateway-grammar"
"""No worker serves it: the one request this module queues stays out of other modules' way."""
CHECK_TIMEOUT_S = 1.0
MAX_SIZE = 10_000
PROMPT_LATENCY_S = 0.5
"""/healthz must answer within this while grammars are checked (the issue saw 12.7 s)."""


@pytest.fixture(scope="module")
def gateway(module_gateway: Callable[..., GatewayProcess]) -> str:
    return module_gateway(QUEUE, "gateway-grammar", GENQ_GATEWAY_GRAMMAR_CHECK_TIMEOUT_S=str(CHECK_TIMEOUT_S),
                          GENQ_GATEWAY_GRAMMAR_CHECK_WORKERS="2", GENQ_GATEWAY_GRAMMAR_MAX_SIZE=str(MAX_SIZE)).url


def slow_gbnf(variant: int, rules: int = 1500) -> str:
    """A GBNF grammar whose conversion to Lark (pure Python, quadratic) takes seconds."""
    body = "".join(f'r{i} ::= "x{variant}-{i}" r{i + 1} | "y"\n' for i in range(rules))
    return f"root ::= r0\n{body}r{rules} ::= \"z\"\n"


def complete(gateway: str, **constraint: Any) -> httpx.Response:
    """A streamed completion (answered at once: a 400, or 200 when queued; no worker serves it)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True, **constraint}
    with httpx.stream("POST", f"{gateway}/v1/completions", headers=bearer(), json=body, timeout=60) as reply:
        if reply.status_code != 200:
            reply.read()
        return reply


def refusal(reply: httpx.Response) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_constraint", error
    message: str = error["message"]
    assert "\n" not in message and len(message) <= MAX_ERROR_CHARS + len("constraint: gbnf: "), message
    return message


def test_healthz_answers_promptly_while_four_hostile_grammars_are_checked(gateway: str):
    with ThreadPoolExecutor(4) as pool:
        replies = [pool.submit(complete, gateway, guided_grammar=slow_gbnf(variant)) for variant in range(4)]
        latencies = []
        while not all(reply.done() for reply in replies):
            started = time.perf_counter()
            assert httpx.get(f"{gateway}/healthz", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - started)
        messages = [refusal(reply.result()) for reply in replies]
    assert len(latencies) >= 5 and max(latencies) < PROMPT_LATENCY_S, latencies
    for message in messages:
        assert message == (f"constraint: gbnf: checking the grammar took longer than {CHECK_TIMEOUT_S:g} s "
                           "(grammar_check_timeout_s)")


def test_the_same_grammar_again_is_answered_from_the_cache(gateway: str):
    grammar = slow_gbnf(99)
    first = refusal(complete(gateway, guided_grammar=grammar))
    started = time.perf_counter()
    again = refusal(complete(gateway, guided_grammar=grammar))
    # Checking it again would take the whole budget: the answer came from the cache.
    assert time.perf_counter() - started < CHECK_TIMEOUT_S
    assert again == first


def test_a_grammar_over_the_size_budget_is_a_400_naming_the_limit(gateway: str):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
    message = refusal(complete(gateway, guided_json=schema))
    assert message.startswith("constraint: json_schema: over llguidance's max_grammar_size limit"), message
    assert f"({MAX_SIZE})" in message


def test_a_grammar_past_an_llguidance_limit_is_one_line_naming_it(gateway: str):
    wide = "start: " + " | ".join(f'"a{i}"' for i in range(3000))
    message = refusal(complete(gateway, guided_grammar=wide))
    assert message.startswith("constraint: lark: over llguidance's max_items_in_row limit (2000)"), message


def test_a_small_constraint_passes_the_check_and_is_queued(gateway: str):
    assert complete(gateway, guided_choice=["yes", "no"]).status_code == 200
