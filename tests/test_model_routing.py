"""Routing by model (issue 28): a gateway in front of two worker pools serving two different
models sends each request to the pool whose card publishes its `model`, lists every model live
from the cards, and answers an unknown one with OpenAI's 404 `model_not_found`; GenqClient picks
the queue the same way. Adapters: the llama pool's worker serves two PEFT adapters
(--lora), its card lists them, /v1/models shows them with their base model as
parent, and an adapter's name runs that adapter (each answer equal to the engine's with it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from celery import Celery

from engine import Generator, Job
from producer.client import GenerationError, GenqClient
from producer.model_routes import ModelRoute, UnknownModel, model_routes
from producer.protocol import GenerationRequest
from tests.engine_runs import run
from tests.gateway_service import MODEL, TOKEN, GatewayProcess, bearer, running_worker
from tests.lora_adapters import save_peft_adapter
from tests.test_lora import ADAPTERS
from worker.jobs import build_job
from worker.model_card import describe

QUEUES = ("routing-llama", "routing-qwen")
PROMPT = "Routing by model"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def with_adapters(tiny_model_factory: Callable[..., Path],
                  tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny llama and two PEFT adapters of it (random non-zero A and B)."""
    base = tiny_model_factory("llama", max_position_embeddings=1024)
    root = tmp_path_factory.mktemp("routing-adapters")
    return base, {name: save_peft_adapter(base, root / name, seed, **options)
                  for seed, (name, options) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def pools(with_adapters: tuple[Path, dict[str, Path]], tiny_model_factory: Callable[..., Path], redis_url: str,
          celery_client: Celery, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """queue -> model dir: a real worker of a different tiny model on each queue, the llama's
    serving the adapters too (--lora)."""
    base, adapters = with_adapters
    models = {QUEUES[0]: base, QUEUES[1]: tiny_model_factory("qwen2", max_position_embeddings=1024, seed=1)}
    loras = {QUEUES[0]: [f"{name}={path}" for name, path in adapters.items()], QUEUES[1]: []}
    with ExitStack() as workers:
        for queue, path in models.items():
            workers.enter_context(running_worker(path, redis_url, celery_client, tmp_path_factory.mktemp(queue),
                                                 queue, queue, cache_tokens=4096, concurrency=4, lora=loras[queue]))
        yield models


@pytest.fixture(scope="module")
def routing_gateway(pools: dict[str, Path], module_gateway: Callable[..., GatewayProcess]) -> GatewayProcess:
    """One gateway fronting both queues."""
    return module_gateway(QUEUES[0], "routing-gateway", GENQ_GATEWAY_QUEUES=",".join(QUEUES))


@pytest.fixture(scope="module")
def oai(routing_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{routing_gateway.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def engine_text(model_dir: Path, prompt: str, adapters: dict[str, Path] | None = None,
                adapter: str | None = None) -> str:
    """The engine's greedy text for `prompt`, run in this process (the reference)."""
    generator = Generator.from_pretrained(str(model_dir))
    for name, path in (adapters or {}).items():
        generator.adapters.register(name, path)
    ids = generator.tokenizer.encode(prompt, add_special_tokens=generator.tokenizer.add_bos_token)
    job = Job(ids, MAX_TOKENS, stop_conditions=[], identifier="reference", adapter=adapter)
    return run(generator, [job])["reference"].full_completion or ""


def test_each_request_runs_on_the_pool_serving_its_model(oai: openai.OpenAI, pools: dict[str, Path]):
    answers = {}
    for path in pools.values():
        reply = oai.completions.create(model=str(path), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert reply.model == str(path)
        answers[path] = reply.choices[0].text
        assert answers[path] == engine_text(path, PROMPT)
    assert len(set(answers.values())) == 2, "the two models must answer differently for routing to show"
    chat = oai.chat.completions.create(model=str(pools[QUEUES[1]]), messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_the_configured_model_name_still_names_the_first_queue_s_model(oai: openai.OpenAI, pools: dict[str, Path]):
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert reply.choices[0].text == engine_text(pools[QUEUES[0]], PROMPT)


def test_models_lists_every_pool_s_model_and_adapter_live_from_the_cards(
        oai: openai.OpenAI, pools: dict[str, Path], with_adapters: tuple[Path, dict[str, Path]]):
    base, adapters = with_adapters
    listed = {model.id: getattr(model, "parent", None) for model in oai.models.list()}
    assert listed == {MODEL: None, **{str(path): None for path in pools.values()},
                      **dict.fromkeys(adapters, str(base))}
    assert oai.models.retrieve(str(pools[QUEUES[1]])).id == str(pools[QUEUES[1]])
    assert getattr(oai.models.retrieve("full"), "parent", None) == str(base)


def test_a_burst_of_adapters_and_the_base_model_each_get_their_own_answer(
        oai: openai.OpenAI, with_adapters: tuple[Path, dict[str, Path]]):
    """Both adapters and the base model (by its card's name), twice each, sent at once to one worker."""
    base, adapters = with_adapters
    names = [*adapters, str(base)] * 2

    def complete(name: str) -> str:
        return oai.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text or ""

    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(complete, names))
    expected = {name: engine_text(base, PROMPT, adapters, name) for name in adapters}
    expected[str(base)] = engine_text(base, PROMPT)
    assert replies == [expected[name] for name in names]
    assert len(set(expected.values())) == 3, "each adapter changes the base model's text"


def test_an_unknown_model_is_openai_s_404_model_not_found(oai: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert isinstance(info.value.body, dict)
    assert (info.value.body["type"], info.value.body["param"]) == ("invalid_request_error", "model")
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_genq_client_routes_by_model_as_the_gateway_does(pools: dict[str, Path], redis_url: str):
    with GenqClient(redis_url, queue=QUEUES[0]) as client:
        for queue, path in pools.items():
            route = client.route(str(path), QUEUES)
            assert route == ModelRoute(str(path), queue, None, str(path))
            request = {"prompt": PROMPT, "max_new_tokens": MAX_TOKENS, "ignore_eos": True,
                       "sampling": {"temperature": 0}}
            assert client.submit(request, queue=route.queue).result(timeout=120).text == engine_text(path, PROMPT)
        with pytest.raises(UnknownModel, match="no-such-model"):
            client.route("no-such-model", QUEUES)


def test_a_webhook_task_routes_by_its_model(routing_gateway: GatewayProcess, pools: dict[str, Path],
                                           redis_url: str):
    path = pools[QUEUES[1]]
    accepted = httpx.post(f"{routing_gateway.url}/v1/tasks", headers=bearer(), timeout=30, json={
        "model": str(path), "prompt": PROMPT, "max_new_tokens": MAX_TOKENS, "ignore_eos": True,
        "sampling": {"temperature": 0}})
    assert accepted.status_code == 202, accepted.text
    with GenqClient(redis_url, queue=QUEUES[0]) as client:
        assert client.handle(accepted.json()["id"]).result(timeout=120).text == engine_text(path, PROMPT)
    unknown = httpx.post(f"{routing_gateway.url}/v1/tasks", headers=bearer(), timeout=30,
                         json={"model": "no-such-model", "prompt": PROMPT})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")


def test_a_worker_refuses_an_adapter_it_does_not_serve(pools: dict[str, Path], redis_url: str):
    with GenqClient(redis_url, queue=QUEUES[0]) as client, pytest.raises(GenerationError, match="no-such-adapter"):
        client.submit({"prompt": PROMPT, "max_new_tokens": 2, "adapter": "no-such-adapter"}).result(timeout=120)


def test_a_worker_card_lists_its_adapters_and_each_routes_to_its_pool(with_adapters: tuple[Path, dict[str, Path]]):
    base, adapters = with_adapters
    generator = Generator.from_pretrained(str(base))
    for name, path in adapters.items():
        generator.adapters.register(name, path)
    card, _, _ = describe(generator, "base-model")
    assert card.adapters == sorted(adapters)
    other, _, _ = describe(Generator.from_pretrained(str(base)), "other-model")
    routes = model_routes([("first", [card]), ("second", [other.model_copy(update={"adapters": ["full"]})])])
    assert routes["full"] == ModelRoute("full", "first", "full", "base-model"), "the earlier queue wins a name"
    assert routes["rs"] == ModelRoute("rs", "first", "rs", "base-model")
    assert routes["other-model"] == ModelRoute("other-model", "second", None, "other-model")


def test_a_request_s_adapter_reaches_the_engine_job(with_adapters: tuple[Path, dict[str, Path]]):
    base, adapters = with_adapters
    generator = Generator.from_pretrained(str(base))
    for name, path in adapters.items():
        generator.adapters.register(name, path)
    request = GenerationRequest.parse_payload({"prompt": PROMPT, "max_new_tokens": MAX_TOKENS, "ignore_eos": True,
                                               "sampling": {"temperature": 0}, "adapter": "full"})
    job = build_job(request, generator.tokenizer, "adapted", generator.model.config.vocab_size)
    assert job.adapter == "full"
    adapted = run(generator, [job])["adapted"].full_completion
    assert adapted == engine_text(base, PROMPT, adapters, "full") != engine_text(base, PROMPT)
