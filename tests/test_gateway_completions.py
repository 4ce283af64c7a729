"""/v1/completions as OpenAI and vLLM have it, end to end (a real redis-server, a real `genq
worker`, the gateway under uvicorn, the official openai client): a list of prompts is one task
per prompt, answered with choice prompt * n + sample, streamed or not; echo; the prompt's
log-probabilities (echo with logprobs, vLLM's prompt_logprobs)."""


from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import tokenizers

from producer.client import GenqClient
from producer.gateway.openai_api import MAX_PROMPTS
from producer.model_card import card_key
from tests.gateway_service import MODEL, QUEUE, TOKEN, GatewayProcess, close_once_two_choices_stream, service_env
from worker.processes import WorkerProcess

PROMPTS = ["Once upon a time", "The weather today", "In a small village"]
TOKENS = 6
SAMPLED: dict[str, Any] = {"max_tokens": TOKENS, "seed": 7, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def reference_tokenizer(model_dir: Path) -> tokenizers.Tokenizer:
    """Hugging Face's tokenizers on the model's tokenizer.json: the reference for token ids and
    their text (its post-processor adds the BOS the worker adds to a string prompt)."""
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def ids_of(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def texts_by_index(chunks: Iterator[Any]) -> tuple[dict[int, str], Counter[int], Any, set[str]]:
    """A streamed answer assembled: each index's text, its finish chunks, the usage, the ids."""
    texts: dict[int, str] = {}
    finishes: Counter[int] = Counter()
    usage, ids = None, set()
    for chunk in chunks:
        ids.add(chunk.id)
        assert len(chunk.choices) <= 1
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] += choice.finish_reason is not None
        if chunk.usage is not None:
            usage = chunk.usage
    return texts, finishes, usage, ids


# --- prompt lists --------------------------------------------------------------------------------


def test_a_list_of_prompts_answers_each_prompt_s_choices_in_openai_s_order(oai: openai.OpenAI, genq: GenqClient):
    reply = oai.completions.create(model=MODEL, prompt=PROMPTS, n=2, **SAMPLED)
    assert [c.index for c in reply.choices] == list(range(6))
    singles = [oai.completions.create(model=MODEL, prompt=prompt, n=2, **SAMPLED) for prompt in PROMPTS]
    assert [c.text for c in reply.choices] == [c.text for single in singles for c in single.choices]
    assert len({c.text for c in reply.choices}) > 2  # the prompts' answers differ
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert reply.usage.completion_tokens == 6 * TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6 * TOKENS
    tasks = [genq.handle(f"{reply.id}-{i}").result(timeout=30) for i in range(3)]  # one task per prompt
    assert [c.text for task in tasks for c in task.choices or ()] == [c.text for c in reply.choices]


def test_token_id_prompts_alone_and_in_lists(oai: openai.OpenAI, reference_tokenizer: tokenizers.Tokenizer):
    ids = [ids_of(reference_tokenizer, prompt) for prompt in PROMPTS[:2]]
    greedy: dict[str, Any] = {"max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    by_text = [oai.completions.create(model=MODEL, prompt=prompt, **greedy) for prompt in PROMPTS[:2]]
    by_ids = oai.completions.create(model=MODEL, prompt=ids[0], **greedy)
    assert by_ids.choices[0].text == by_text[0].choices[0].text  # the ids the worker reads the text as
    assert by_ids.usage.prompt_tokens == len(ids[0]) == by_text[0].usage.prompt_tokens
    listed = oai.completions.create(model=MODEL, prompt=ids, **greedy)
    assert [c.index for c in listed.choices] == [0, 1]
    assert [c.text for c in listed.choices] == [r.choices[0].text for r in by_text]
    assert listed.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_a_streamed_list_assembles_per_index_to_the_non_streamed_answer(oai: openai.OpenAI):
    whole = oai.completions.create(model=MODEL, prompt=PROMPTS, n=2, **SAMPLED)
    stream = oai.completions.create(model=MODEL, prompt=PROMPTS, n=2, stream=True,
                                    stream_options={"include_usage": True}, **SAMPLED)
    texts, finishes, usage, ids = texts_by_index(stream)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == Counter(dict.fromkeys(range(6), 1))
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert usage is not None and usage.completion_tokens == 6 * TOKENS
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_closing_a_streamed_list_cancels_every_prompt_s_task(oai: openai.OpenAI, genq: GenqClient):
    stream = oai.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=900, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    stream_id = close_once_two_choices_stream(stream)
    results = [genq.handle(f"{stream_id}-{i}").result(timeout=60) for i in (0, 1)]
    assert all(r.finish_reason == "cancelled" and r.usage.completion_tokens < 900 for r in results)


# --- echo ----------------------------------------------------------------------------------------


def test_echo_begins_each_choice_with_its_prompt(oai: openai.OpenAI, reference_tokenizer: tokenizers.Tokenizer):
    plain = oai.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, **SAMPLED)
    echoed = oai.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, echo=True, **SAMPLED)
    assert [c.text for c in echoed.choices] == [PROMPTS[c.index // 2] + c.text for c in plain.choices]
    ids = ids_of(reference_tokenizer, PROMPTS[0])
    by_ids = oai.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=TOKENS, temperature=0)
    shown = reference_tokenizer.decode(ids, skip_special_tokens=False)
    assert shown != PROMPTS[0] and shown.endswith(PROMPTS[0])  # the BOS the ids hold is shown too
    assert by_ids.choices[0].text.startswith(shown) and len(by_ids.choices[0].text) > len(shown)


def test_streamed_echo_sends_each_prompt_first(oai: openai.OpenAI):
    whole = oai.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, echo=True, **SAMPLED)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, echo=True, stream=True, **SAMPLED))
    firsts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
    assert firsts == {index: PROMPTS[index // 2] for index in range(4)}
    texts, _, _, _ = texts_by_index(iter(chunks))
    assert texts == {c.index: c.text for c in whole.choices}


# --- refusals ------------------------------------------------------------------------------------


@contextmanager
def idle_gateway_of(redis_url: str, redis_client: redis.Redis, log_dir: Path, *, card: bool
                    ) -> Iterator[tuple[openai.OpenAI, str]]:
    """A gateway on a queue no worker consumes, so that the queue's length shows what was queued;
    with `card`, the real worker's model card (copied)."""
    queue = f"genq-completions-idle-{uuid.uuid4().hex[:8]}"
    if card:
        redis_client.copy(card_key(QUEUE, "genq"), card_key(queue, "genq"))
    env = {**service_env(redis_url), "GENQ_QUEUE": queue, "GENQ_GATEWAY_TOKEN": TOKEN, "GENQ_GATEWAY_MODEL_NAME": MODEL}
    started = GatewayProcess(env, log_dir / "gateway.log").start()
    try:
        yield openai.OpenAI(base_url=f"{started.url}/v1", api_key=TOKEN, max_retries=0, timeout=60), queue
    finally:
        started.stop()
        redis_client.delete(queue, card_key(queue, "genq"))


@pytest.fixture(scope="module")
def idle_gateway(worker: WorkerProcess, redis_url: str, redis_client: redis.Redis,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    with idle_gateway_of(redis_url, redis_client, tmp_path_factory.mktemp("idle-gateway"), card=True) as idle:
        yield idle


def test_echo_of_token_ids_without_a_model_card_is_a_400_saying_why(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path):
    with idle_gateway_of(redis_url, redis_client, tmp_path, card=False) as (oai, queue):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model=MODEL, prompt=[5, 6], echo=True, max_tokens=2)
        assert refused.value.param == "echo" and refused.value.code == "tokenizer_unavailable"
        assert "tokenizer" in refused.value.message and "model card" in refused.value.message
        assert redis_client.llen(queue) == 0
        with oai.completions.create(model=MODEL, prompt="x", echo=True, max_tokens=2, stream=True):
            assert redis_client.llen(queue) == 1  # a string prompt echoes as sent: no tokenizer needed


def test_a_bad_prompt_in_a_list_is_a_400_naming_it_and_nothing_is_queued(
        idle_gateway: tuple[openai.OpenAI, str], redis_client: redis.Redis):
    oai, queue = idle_gateway
    for prompts, problem in (([[5, 6], [5, 10**6], [7]], "prompt[1]"), (["fine", "word " * 2000, "fine"], "prompt[1]")):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model=MODEL, prompt=prompts, max_tokens=2, stream=True)
        assert refused.value.param == problem, refused.value.body
        assert redis_client.llen(queue) == 0
    with oai.completions.create(model=MODEL, prompt=[[5, 6], [5, 9], [7]], max_tokens=2, stream=True):
        assert redis_client.llen(queue) == 3  # the same list, valid: a task per prompt


def test_the_list_is_bounded(oai: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt=["x"] * (MAX_PROMPTS + 1), max_tokens=2)
    assert refused.value.param == "prompt" and f"at most {MAX_PROMPTS} prompts" in refused.value.message
    with pytest.raises(openai.BadRequestError) as empty:
        oai.completions.create(model=MODEL, prompt=[], max_tokens=2)
    assert empty.value.param == "prompt"


# --- the prompt's log-probabilities (the worker's prompt_logprobs) --------------------------------


def test_echo_with_logprobs_puts_the_prompt_s_tokens_first(oai: openai.OpenAI, genq: GenqClient,
                                                           reference_tokenizer: tokenizers.Tokenizer):
    """The prompt's token logprobs equal the logprobs the same tokens had when generated: the
    prompt is a greedy completion's prompt and tokens (its task's token ids)."""
    start = ids_of(reference_tokenizer, PROMPTS[0])
    greedy = oai.completions.create(model=MODEL, prompt=start, max_tokens=TOKENS, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    generated = greedy.choices[0].logprobs
    assert generated is not None and len(generated.tokens) == TOKENS
    continued = start + genq.handle(greedy.id).result(timeout=30).token_ids
    assert len(continued) == len(start) + TOKENS
    echoed = oai.completions.create(model=MODEL, prompt=continued, max_tokens=2, temperature=0, logprobs=2,
                                    echo=True)
    choice = echoed.choices[0]
    shown = reference_tokenizer.decode(continued, skip_special_tokens=False)
    assert choice.text.startswith(shown)
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(continued) + 2
    assert logprobs.tokens[0] == reference_tokenizer.decode(continued[:1], skip_special_tokens=False)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[len(start):len(continued)] == generated.tokens
    assert logprobs.token_logprobs[len(start):len(continued)] == pytest.approx(generated.token_logprobs, abs=1e-3)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_prompt_logprobs_in_vllm_s_shape_on_both_endpoints(oai: openai.OpenAI,
                                                           reference_tokenizer: tokenizers.Tokenizer):
    ids = ids_of(reference_tokenizer, PROMPTS[1])
    reply = oai.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=2, temperature=0,
                                   extra_body={"prompt_logprobs": 3})
    for choice in reply.choices:
        shaped = choice.model_extra["prompt_logprobs"]
        assert len(shaped) == len(ids) and shaped[0] is None
        for token, entry in zip(ids[1:], shaped[1:]):
            assert str(token) in entry and len(entry) <= 4
            assert entry[str(token)]["decoded_token"] == reference_tokenizer.decode([token], skip_special_tokens=False)
            ranks = sorted(e["rank"] for key, e in entry.items() if e["rank"] is not None)
            assert ranks[:3] == [1, 2, 3][:len(ranks)]
            assert all(e["logprob"] <= 0 for e in entry.values())
    # the same prompt twice: the same tokens and ranks; the values within float32 batch rounding (the
    # two tasks may be prefilled in one batch or in two, and a matmul's sums depend on the batch)
    first, second = (choice.model_extra["prompt_logprobs"] for choice in reply.choices)
    assert [e and {k: v["rank"] for k, v in e.items()} for e in first] == \
        [e and {k: v["rank"] for k, v in e.items()} for e in second]
    assert all(abs(a[k]["logprob"] - b[k]["logprob"]) < 1e-5 for a, b in zip(first[1:], second[1:]) for k in a)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": 0})
    shaped = chat.model_extra["prompt_logprobs"]
    assert shaped[0] is None and len(shaped) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in shaped[1:])
    plain = oai.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})  # only when asked
