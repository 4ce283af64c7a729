"""A bounded fuzz of the real gateway (`genq gateway` under uvicorn, real Redis): random JSON and
non-JSON bodies, headers and path segments against every endpoint. Whatever arrives, the answer
is never a 5xx, and every refusal is the gateway's single error shape.

The gateway serves a queue nobody consumes, kept over its admission limit by one filler entry,
so a request that passes every check is answered 429 instead of starting GPU work; streams of
unknown tasks end after a short idle timeout. The example count keeps the run to tens of
seconds; hypothesis prints the failing example (and how to reproduce it) if one is found. Run
against the code before issue 16, it finds the 500s of a text content part without a string
`text` and of a callback host with an empty label within those examples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from producer.gateway.errors import ErrorBody
from producer.signing import signed_headers
from tests.gateway_service import MODEL, SECRET, TOKEN, GatewayProcess, service_env

FUZZ_QUEUE = "genq-gateway-fuzz"
EXAMPLES = 1000

# --- strategies ---------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**40), max_value=10**40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)

# Hosts that never reach a DNS server: numeric spellings (the resolver parses them) and names no
# resolver takes (empty or over-long labels), so the fuzz stays fast and offline.
callback_hosts = st.one_of(
    st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda address: f"[{address}]"),
    st.integers(min_value=0, max_value=2**32 - 1).map(str), st.integers(min_value=0, max_value=2**32 - 1).map(hex),
    st.sampled_from(["localhost", "[::1%25lo]", "0x7f.1", "0177.0.0.1", "[::ffff:0:0]"]),
    st.lists(st.sampled_from(["", "a" * 64, "0"]), min_size=2, max_size=4).map(".".join))
callback_urls = st.builds("{}://{}{}/{}".format, st.sampled_from(["http", "https", "ftp", "file", "HTTP"]),
                          callback_hosts, st.sampled_from(["", ":0", ":80", ":65536", ":x"]), st.text(max_size=5))


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly of its own shape (valid, or just out of range), sometimes any JSON."""
    return st.one_of(strategy, strategy, strategy, json_values)


ints = st.integers(min_value=0, max_value=64) | st.integers() | st.sampled_from([-1, 2**31, 2**63, 10**30])
unit_floats = st.floats(min_value=0, max_value=1) | st.floats() | ints
texts = st.text(max_size=20) | st.sampled_from(["", "x" * 300, "\n\n", "ok-id", "a" * 129, MODEL])
token_lists = st.lists(ints, min_size=1, max_size=5)
content_parts = st.lists(st.fixed_dictionaries({"type": maybe(st.sampled_from(["text", "image_url"]))},
                                               optional={"text": maybe(texts)}), min_size=1, max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"])),
     "content": maybe(texts | content_parts)}), min_size=1, max_size=3)
token_bias = st.dictionaries(ints.map(str) | texts, unit_floats, max_size=3)
sampling = st.fixed_dictionaries({}, optional={
    **{name: maybe(unit_floats) for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                            "frequency_penalty", "presence_penalty")},
    "top_k": maybe(ints), "seed": maybe(ints), "banned_token_ids": maybe(token_lists),
    "token_bias": maybe(token_bias)})
TASK_FIELDS = {
    "prompt": maybe(texts), "messages": maybe(messages), "input_ids": maybe(token_lists),
    "max_new_tokens": maybe(ints), "min_new_tokens": maybe(ints), "sampling": maybe(sampling),
    "stop": maybe(st.lists(texts, max_size=3)), "stop_token_ids": maybe(token_lists),
    "ignore_eos": maybe(st.booleans()), "add_bos": maybe(st.booleans()), "identifier": maybe(texts),
    "priority": maybe(ints), "deadline": maybe(unit_floats), "timeout_s": maybe(unit_floats),
    "stream": maybe(st.fixed_dictionaries({}, optional={"enabled": maybe(st.booleans()),
                                                        "include_token_ids": maybe(st.booleans())})),
    "metadata": maybe(st.dictionaries(texts, texts, max_size=3)), "callback_url": maybe(callback_urls),
    "bogus": json_values}
OPENAI_FIELDS = {
    "model": maybe(texts), "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans())})),
    "max_tokens": maybe(ints), "n": maybe(ints), "stop": maybe(texts | st.lists(texts, max_size=3)),
    "seed": maybe(ints), "logit_bias": maybe(token_bias), "user": maybe(texts), "top_k": maybe(ints),
    "min_tokens": maybe(ints), "ignore_eos": maybe(st.booleans()),
    **{name: maybe(unit_floats) for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                                            "min_p", "repetition_penalty")}}
COMPLETION_FIELDS = {**OPENAI_FIELDS, "prompt": maybe(texts | token_lists | st.lists(texts, max_size=2)
                                                      | st.lists(token_lists, max_size=2)),
                     "echo": maybe(st.booleans()), "logprobs": maybe(ints), "best_of": maybe(ints),
                     "suffix": maybe(texts)}
CHAT_FIELDS = {**OPENAI_FIELDS, "messages": maybe(messages), "max_completion_tokens": maybe(ints),
               "logprobs": maybe(st.booleans()), "top_logprobs": maybe(ints),
               "tools": maybe(st.lists(json_values, max_size=2)), "tool_choice": json_values,
               "response_format": maybe(st.fixed_dictionaries({"type": maybe(st.sampled_from(["text", "json"]))}))}
SHAPED = {"/v1/tasks": ({"prompt": st.one_of(texts, st.just("hi")), "callback_url": st.none() | callback_urls},
                        TASK_FIELDS),
          "/v1/completions": ({"model": st.just(MODEL), "prompt": COMPLETION_FIELDS["prompt"]}, COMPLETION_FIELDS),
          "/v1/chat/completions": ({"model": st.just(MODEL), "messages": messages}, CHAT_FIELDS)}
"""Per POST endpoint, the fields a request needs (with mostly valid values) and a strategy per
field. A shaped body has the needed fields, rarely one dropped, and up to two more, so that most
bodies get past JSON parsing into the checks of each field, and some pass every check."""


@st.composite
def shaped_bodies(draw: st.DrawFn, path: str) -> bytes:
    needed, fields = SHAPED.get(path, SHAPED["/v1/tasks"])
    body = {name: draw(strategy) for name, strategy in needed.items()}
    if draw(st.integers(min_value=0, max_value=9)) == 0:
        del body[draw(st.sampled_from(sorted(body)))]
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=2)):
        body[name] = draw(fields[name])
    return json.dumps(body).encode()


json_bodies = json_values.map(lambda value: json.dumps(value).encode())
deep_bodies = st.integers(min_value=1, max_value=5000).map(lambda depth: b"[" * depth + b"]" * depth)
long_numbers = st.integers(min_value=4000, max_value=6000).map(lambda digits: b'{"prompt":"x","max_tokens":'
                                                               + b"7" * digits + b"}")
bodies = json_bodies | st.binary(max_size=64) | deep_bodies | long_numbers | st.just(b"")

_HEADER_BYTES = [9, *range(0x20, 0x7F), *range(0x80, 0x100)]
header_values = st.lists(st.sampled_from(_HEADER_BYTES), max_size=40).map(bytes).map(bytes.strip)
segments = (st.text(max_size=30).map(lambda text: quote(text, safe=""))
            | st.sampled_from(["ok-id", "a" * 129, "..", "%2e%2e", "%00", "%ZZ", "-x", "a:b.c_d"]))

POSTS = [("POST", "/v1/tasks"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
ENDPOINTS = [*POSTS, *POSTS, *POSTS,  # the bodies have the most to explore
             ("GET", "/v1/tasks/{}"), ("DELETE", "/v1/tasks/{}"), ("GET", "/v1/tasks/{}/events"),
             ("GET", "/v1/models"), ("GET", "/v1/models/{}"), ("GET", "/healthz"), ("GET", "/metrics"),
             ("PUT", "/v1/tasks/{}"),
             ("GET", "/{}")]


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, bytes | str], bytes]:
    method, template = draw(st.sampled_from(ENDPOINTS))
    path = template.format(draw(segments))
    if method in ("POST", "PUT"):
        body = draw(st.one_of(shaped_bodies(template), shaped_bodies(template), bodies))
    else:
        body = draw(bodies) if draw(st.booleans()) else b""
    headers: dict[str, bytes | str] = {}
    authorization = draw(st.sampled_from(["token"] * 8 + ["random", "none"]))
    if authorization == "token":
        headers["Authorization"] = f"Bearer {TOKEN}"
    elif authorization == "random":
        headers["Authorization"] = draw(header_values)
    if draw(st.booleans()):
        headers["Content-Type"] = draw(st.sampled_from([b"application/json", b"text/plain"]) | header_values)
    if draw(st.booleans()):
        headers["Last-Event-ID"] = draw(st.sampled_from([b"1-0", b"1-\xb2", b"0-99999999999999999999"])
                                        | header_values)
    signature = draw(st.sampled_from(["valid", "random", "none"]))
    if signature == "valid":
        headers.update(signed_headers(SECRET, body))
    elif signature == "random":
        headers["X-Genq-Timestamp"] = draw(header_values)
        headers["X-Genq-Signature"] = draw(header_values)
    return method, path, headers, body


# --- the fuzz -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    broker = redis.Redis.from_url(redis_url)
    broker.lpush(FUZZ_QUEUE, "filler")  # one waiting entry: over the limit of 0
    env = {**service_env(redis_url), "GENQ_QUEUE": FUZZ_QUEUE, "GENQ_GATEWAY_TOKEN": TOKEN,
           "GENQ_GATEWAY_MODEL_NAME": MODEL, "GENQ_GATEWAY_MAX_QUEUE_DEPTH": "0",
           "GENQ_GATEWAY_STREAM_IDLE_TIMEOUT_S": "0.2", "GENQ_GATEWAY_MAX_BODY_BYTES": "65536"}
    started = GatewayProcess(env, tmp_path_factory.mktemp("fuzz-gateway") / "gateway.log").start()
    try:
        yield started
    finally:
        started.stop()
        broker.delete(FUZZ_QUEUE)


@pytest.fixture(scope="module")
def http(fuzz_gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_gateway.url, timeout=30) as client:
        yield client


def check_answer(response: httpx.Response, request: Any) -> None:
    assert response.status_code < 500, (request, response.status_code, response.text[:500])
    if response.status_code >= 400:
        ErrorBody.model_validate_json(response.content)
    elif response.headers.get("content-type", "").startswith("application/json"):
        json.loads(response.content)


@settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_no_request_gets_a_5xx_or_a_malformed_error(http: httpx.Client, fuzz_gateway: GatewayProcess,
                                                    request: tuple[str, str, dict[str, bytes | str], bytes]):
    method, path, headers, body = request
    with http.stream(method, path, headers=headers, content=body) as response:
        response.read()
    event(f"{method} {response.status_code}")  # the spread of answers, in --hypothesis-show-statistics
    check_answer(response, request)
    assert fuzz_gateway.process.poll() is None, fuzz_gateway.log()[-2000:]
