"""POST /tokenize and /detokenize (producer/gateway/tokens.py): the gateway answers them from the
model card a real worker publishes, without a task. Their tokens are checked against the worker's
own count of the same request (usage.prompt_tokens), against the engine's tokenizer, and against
transformers' rendering of the same chat; the chat template the card carries renders as
transformers does."""

from __future__ import annotations

import json
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient

from chat_template import ChatTemplate
from engine import Tokenizer
from producer.chat_rendering import render_messages
from producer.gateway import GatewaySettings, create_app
from producer.model_card import CHAT_TEMPLATE_JSON, WorkerCard, card_key
from producer.protocol import GenerationRequest
from producer.tool_calls import template_messages
from tests.gateway_service import MODEL, SECRET, TOKEN, GatewayProcess, bearer, oai  # noqa: F401 - oai: fixture
from tests.test_chat_template_tools import (  # noqa: F401 - tokenizer_pair is a fixture
    CHATML,
    FAMILIES,
    HERMES_2_PRO_TOOL_USE,
    QWEN2_5,
    TOOLS,
    _conversation,
    tokenizer_pair,
)
from worker.processes import WorkerProcess, wait_until

transformers = pytest.importorskip("transformers")

QUEUE = "genq-tokens"
MAX_SEQ_LEN = 2048
PROMPTS = ["Hello world", "<s>starts with BOS", "  spaces \n\n and lines  ", "ünïcödé 🙂"]


# --- the published template renders as transformers does ------------------------------------


def published(tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template as the gateway reads it from the card: the worker's, through its JSON."""
    return CHAT_TEMPLATE_JSON.validate_json(CHAT_TEMPLATE_JSON.dump_json(tokenizer.chat))


TEMPLATES = {**{family: template for family, (template, _) in FAMILIES.items()}, "chatml": CHATML,
             "hermes-2-pro-default-and-tool-use": [{"name": "default", "template": CHATML},
                                                   {"name": "tool_use", "template": HERMES_2_PRO_TOOL_USE}]}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_published_template_renders_as_transformers(tokenizer_pair, name: str):  # noqa: F811
    ours, reference = tokenizer_pair(TEMPLATES[name])
    chat = published(ours)
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for add_generation_prompt in (True, False) if name != "hermes-2-pro" else ():  # its tool_use template alone
        assert chat.render(plain, add_generation_prompt) == reference.apply_chat_template(
            plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    if name == "chatml":
        return  # no tool support: a chat with tools gets the generic tool prompt (below)
    messages = template_messages(_conversation(parallel=False))
    assert chat.render(messages, tools=TOOLS) == reference.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", ["chatml", "qwen2.5", "hermes-2-pro-default-and-tool-use"])
def test_a_continued_final_message_renders_as_transformers(tokenizer_pair, name: str):  # noqa: F811
    ours, reference = tokenizer_pair(TEMPLATES[name])
    messages = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moon, "}]
    request = GenerationRequest.parse_payload({"messages": messages, "continue_final_message": True,
                                               "add_generation_prompt": False})
    assert render_messages(request, published(ours)) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)


# --- through a real worker and gateway -------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with two templates: its own (which writes BOS) as the default, Qwen 2.5's
    (tools, no BOS) as "tool_use", so the card carries both and both BOS cases are met."""
    out = tmp_path_factory.mktemp("tokens-model") / "model"
    shutil.copytree(tiny_model_factory("llama", max_position_embeddings=MAX_SEQ_LEN), out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": config["chat_template"]},
                               {"name": "tool_use", "template": QWEN2_5}]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "tokens-worker")


@pytest.fixture(scope="module")
def card(worker: WorkerProcess, redis_client: redis.Redis) -> WorkerCard:
    raw = wait_until(lambda: redis_client.hget(card_key(QUEUE, "genq"), worker.node), 30, "the worker's card")
    return WorkerCard.model_validate_json(raw)


@pytest.fixture(scope="module")
def gateway(card: WorkerCard, module_gateway: Callable[..., GatewayProcess]) -> str:
    return module_gateway(QUEUE, "tokens-gateway").url


def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers=bearer(), timeout=30)


def tokenize(base: str, body: dict[str, Any]) -> dict[str, Any]:
    response = post(base, "/tokenize", body)
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    return response.json()["error"]


def test_the_card_names_the_chat_template_and_bos(card: WorkerCard, tokenizer: Tokenizer,
                                                  redis_client: redis.Redis):
    assert card.bos_token_id == tokenizer.bos_token_id is not None
    assert card.chat_template_digest is not None
    stored = redis_client.get(f"genq:chat_template:{card.chat_template_digest}")
    assert CHAT_TEMPLATE_JSON.validate_json(stored) == tokenizer.chat
    assert tokenizer.chat.template and tokenizer.chat.tool_template == QWEN2_5


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_prompt_s_tokens_are_the_worker_s(gateway: str, oai: openai.OpenAI, tokenizer: Tokenizer, prompt: str):  # noqa: F811
    answer = tokenize(gateway, {"prompt": prompt, "model": MODEL, "return_token_strs": True})
    assert answer["tokens"] == tokenizer.encode(prompt, add_special_tokens=tokenizer.add_bos_token)
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == MAX_SEQ_LEN
    assert answer["token_strs"] == [tokenizer.id_to_token(token) for token in answer["tokens"]]
    completion = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert completion.usage is not None and completion.usage.prompt_tokens == answer["count"]
    plain = tokenize(gateway, {"prompt": prompt, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert plain["token_strs"] is None


CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
CHATS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]},
    "no-generation-prompt": {"messages": [{"role": "user", "content": "Hi there"}], "add_generation_prompt": False},
    "continued": {"messages": [{"role": "user", "content": "Write a haiku."},
                               {"role": "assistant", "content": "Autumn moon, "}],
                  "add_generation_prompt": False, "continue_final_message": True},
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"},
                           {"role": "assistant", "content": None, "tool_calls": CALLS},
                           {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
                           {"role": "user", "content": "And Rome?"}], "tools": TOOLS},
    "tools-continued": {"messages": [{"role": "user", "content": "Weather in Rome?"},
                                     {"role": "assistant", "content": "Let me check"}], "tools": TOOLS,
                        "add_generation_prompt": False, "continue_final_message": True},
}


@pytest.mark.parametrize("case", sorted(CHATS))
def test_a_chat_s_tokens_are_the_worker_s(gateway: str, oai: openai.OpenAI, tokenizer: Tokenizer, reference: Any,  # noqa: F811
                                          case: str):
    fields = CHATS[case]
    answer = tokenize(gateway, {**fields, "model": MODEL})
    assert answer["count"] == len(answer["tokens"])
    extras = {name: fields[name] for name in ("add_generation_prompt", "continue_final_message") if name in fields}
    chat = oai.chat.completions.create(model=MODEL, messages=fields["messages"],
                                       tools=fields.get("tools", openai.NOT_GIVEN), max_tokens=1, temperature=0,
                                       extra_body=extras)
    assert chat.usage is not None and chat.usage.prompt_tokens == answer["count"]
    request = GenerationRequest.parse_payload(fields)
    assert answer["tokens"] == tokenizer.encode_rendered(render_messages(request, tokenizer.chat))
    # transformers renders the same text; the worker adds BOS where the template did not write it.
    text = reference.apply_chat_template(
        template_messages([m.model_dump(exclude_none=True) for m in request.messages or ()]),
        tools=fields.get("tools"), tokenize=False, add_generation_prompt=fields.get("add_generation_prompt", True),
        continue_final_message=fields.get("continue_final_message", False))
    ids = reference.encode(text, add_special_tokens=False)
    bos = reference.bos_token_id
    assert answer["tokens"] == (ids if ids[:1] == [bos] else [bos, *ids])
    if "tools" in fields:
        assert ids[:1] != [bos] and "get_weather" in text  # the tool_use template (no BOS) rendered the tools


def test_add_special_tokens_encodes_the_rendered_chat_as_a_prompt(gateway: str, tokenizer: Tokenizer):
    fields = CHATS["plain"]
    text = render_messages(GenerationRequest.parse_payload(fields), tokenizer.chat)
    answer = tokenize(gateway, {**fields, "add_special_tokens": True})
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=tokenizer.add_bos_token)
    assert answer["tokens"][:2] == [tokenizer.bos_token_id] * 2  # vLLM's meaning: on top of the template's BOS


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_detokenize_gives_back_the_text(gateway: str, reference: Any, add_special_tokens: bool):
    for prompt in PROMPTS:
        tokens = tokenize(gateway, {"prompt": prompt, "add_special_tokens": add_special_tokens})["tokens"]
        response = post(gateway, "/detokenize", {"tokens": tokens, "model": MODEL})
        assert response.status_code == 200, response.text
        assert response.json() == {"prompt": reference.decode(tokens)}
        if not add_special_tokens:
            assert response.json()["prompt"] == prompt


def test_a_token_outside_the_vocabulary_is_a_400_naming_it(gateway: str, card: WorkerCard):
    for tokens, index in (([5, card.vocab_size], 1), ([-1], 0)):
        error = error_of(post(gateway, "/detokenize", {"tokens": tokens}), 400)
        assert error["param"] == f"tokens[{index}]"
        assert f"tokens[{index}]" in error["message"] and f"[0, {card.vocab_size})" in error["message"]


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})])
def test_another_model_is_a_404(gateway: str, path: str, body: dict[str, Any]):
    error = error_of(post(gateway, path, {**body, "model": "gpt-4"}), 404)
    assert error["param"] == "model" and "'gpt-4'" in error["message"] and MODEL in error["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "prompt", "exactly one"),
    ({}, "prompt", "exactly one"),
    ({"prompt": "Hi", "tools": TOOLS}, "tools", "only with messages"),
    ({"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True},
     "continue_final_message|add_generation_prompt", "add_generation_prompt false"),
    ({"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 1 }}"}, "chat_template",
     "Extra inputs"),
])
def test_a_malformed_request_is_a_400_naming_the_field(gateway: str, body: dict[str, Any], param: str, words: str):
    error = error_of(post(gateway, "/tokenize", body), 400)
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "Hi", "nmae": "ann"}, "messages[0].nmae"),
    ({"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]},
     "messages[0].content[0].cache_control"),
], ids=["message", "content-part"])
def test_an_unknown_key_in_a_message_is_a_400_naming_it(gateway: str, message: dict[str, Any], param: str):
    """As POST /v1/chat/completions refuses it (tests/test_gateway_nested_params.py)."""
    error = error_of(post(gateway, "/tokenize", {"messages": [message]}), 400)
    assert (error["code"], error["param"]) == ("unknown_parameter", param)
    assert f"'{param}'" in error["message"]


def test_a_chat_the_template_refuses_is_a_400(gateway: str):
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late"}]
    error = error_of(post(gateway, "/tokenize", {"messages": messages}), 400)
    assert error["param"] == "messages" and "Only the first message may be a system message" in error["message"]


def test_the_gateway_token_is_required(gateway: str):
    response = httpx.post(f"{gateway}/tokenize", json={"prompt": "Hi"}, timeout=30)
    assert error_of(response, 401)["code"] == "invalid_api_key"


def test_tokenize_answers_while_the_worker_is_stopped(gateway: str, worker: WorkerProcess, tokenizer: Tokenizer):
    """No task round trip: with the worker frozen (SIGSTOP) nothing could answer a task, and the
    gateway still tokenizes from the card the worker published."""
    worker.signal(signal.SIGSTOP)
    try:
        prompt = tokenize(gateway, {"prompt": "Hello world"})
        chat = tokenize(gateway, CHATS["tools"])
        detokenized = post(gateway, "/detokenize", {"tokens": prompt["tokens"]})
    finally:
        worker.signal(signal.SIGCONT)
    assert prompt["tokens"] == tokenizer.encode("Hello world", add_special_tokens=tokenizer.add_bos_token)
    request = GenerationRequest.parse_payload(CHATS["tools"])
    assert chat["tokens"] == tokenizer.encode_rendered(render_messages(request, tokenizer.chat))
    assert detokenized.status_code == 200 and detokenized.json()["prompt"].endswith("Hello world")


# --- without a card, or with an older worker's card -------------------------------------------


def in_process_gateway(redis_url: str, queue: str) -> TestClient:
    """The gateway app in this process, in front of `queue`, which no worker consumes."""
    return TestClient(create_app(GatewaySettings(token=TOKEN, webhook_secret=SECRET, redis_url=redis_url,
                                                 queue=queue, model_name=MODEL)))


def test_without_a_card_tokenize_is_a_503_saying_so(redis_url: str):
    with in_process_gateway(redis_url, f"genq-tokens-empty-{uuid.uuid4().hex[:8]}") as client:
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            response = client.post(path, json=body, headers=bearer())
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "model_card_unavailable" and "param" not in error
            assert response.headers["Retry-After"]
            assert "no worker has published its model card yet" in error["message"]


def test_an_older_worker_s_card_tokenizes_prompts_and_refuses_chats_clearly(
        card: WorkerCard, redis_url: str, redis_client: redis.Redis, tokenizer: Tokenizer):
    """A card without chat_template_digest (a worker from before it was published)."""
    queue = f"genq-tokens-old-{uuid.uuid4().hex[:8]}"
    older = card.model_copy(update={"chat_template_digest": None, "heartbeat_at": time.time()})
    redis_client.hset(card_key(queue, "genq"), "old-worker@genq", older.model_dump_json())
    try:
        with in_process_gateway(redis_url, queue) as client:
            prompt = client.post("/tokenize", json={"prompt": "Hi"}, headers=bearer())
            assert prompt.status_code == 200, prompt.text
            assert prompt.json()["tokens"] == tokenizer.encode("Hi", add_special_tokens=tokenizer.add_bos_token)
            chat = client.post("/tokenize", json=CHATS["plain"], headers=bearer())
            assert chat.status_code == 503, chat.text
            assert chat.json()["error"]["code"] == "chat_template_unavailable"
            assert "carries no chat template" in chat.json()["error"]["message"]
    finally:
        redis_client.delete(card_key(queue, "genq"))
