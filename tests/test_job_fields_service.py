"""banned_strings and token_healing through the service: the wire protocol, a real worker, the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from celery import Celery

from engine import Tokenizer
from producer.cli import request_from_args
from producer.protocol import TASK_NAME, GenerationRequest, GenerationResult, ProtocolError
from tests.gateway_service import MODEL, QUEUE
from worker.cli import build_parser
from worker.jobs import build_job
from worker.processes import WorkerProcess


@pytest.mark.parametrize(("fields", "expected"), [
    ({"banned_strings": [""]}, "banned_strings[0]: String should have at least 1 character"),
    ({"banned_strings": ["x"] * 65}, "banned_strings: at most 64 items allowed, got 65"),
    ({"token_healing": "yes"}, "token_healing: Input should be a valid boolean"),
])
def test_the_new_job_fields_are_validated_naming_them(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(ProtocolError) as error:
        GenerationRequest.parse_payload({"prompt": "hi", **fields})
    assert expected in str(error.value)


def test_a_real_worker_never_produces_a_banned_string_and_heals_the_prompt(worker: WorkerProcess,
                                                                           celery_client: Celery) -> None:
    def send(identifier: str, **request: Any) -> GenerationResult:
        handle = celery_client.send_task(TASK_NAME, queue=QUEUE, kwargs={
            "prompt": "the cat sat on the mat and then", "max_new_tokens": 24, "ignore_eos": True,
            "identifier": identifier, **request})
        return GenerationResult.from_dict(handle.get(timeout=120))

    free = send("banned-free")
    visible = free.text.strip()
    assert len(visible) > 12, free.text
    banned = visible[len(visible) // 3 : len(visible) // 3 + 5]
    kept = send("banned-kept", banned_strings=[banned])
    assert banned not in kept.text and kept.usage.completion_tokens == 24
    healed = send("healed", token_healing=True)
    assert healed.usage.prompt_tokens == free.usage.prompt_tokens - 1


def test_the_gateway_takes_them_under_tabbyapi_s_names(oai: openai.OpenAI) -> None:
    free = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = free.choices[0].text.strip()
    banned = text[len(text) // 3 : len(text) // 3 + 4]
    kept = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "banned_strings": banned, "token_healing": True})
    assert banned not in kept.choices[0].text
    assert kept.usage.prompt_tokens == free.usage.prompt_tokens - 1


def test_the_cli_sends_banned_strings_and_token_healing() -> None:
    args = build_parser().parse_args(["submit", "print('Hel", "--ban", "As an AI", "--ban", "x", "--token-healing"])
    request = request_from_args(args)
    assert request["banned_strings"] == ["As an AI", "x"] and request["token_healing"] is True
    GenerationRequest.parse_payload(request)


def test_every_wire_job_field_reaches_the_engine_job(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(model_dir)
    fields = {"max_new_tokens": 9, "min_new_tokens": 2, "decode_special_tokens": True, "priority": 3,
              "max_skips": 5, "logprobs": True, "top_logprobs": 4, "banned_strings": ["As an AI"],
              "token_healing": True, "prompt_logprobs": 3}
    request = GenerationRequest.parse_payload({"prompt": "the cat", **fields})
    job = build_job(request, tokenizer, "id", tokenizer.vocab_size)
    for name, value in fields.items():
        assert getattr(job, name) == (tuple(value) if isinstance(value, list) else value), name
    assert build_job(GenerationRequest.parse_payload({"prompt": "x"}), tokenizer, "id",
                     tokenizer.vocab_size).max_skips is None  # the worker's own setting


def test_max_skips_is_bounded_and_sent_by_the_cli() -> None:
    with pytest.raises(ProtocolError, match="max_skips: Input should be less than or equal to 1024"):
        GenerationRequest.parse_payload({"prompt": "hi", "max_skips": 1025})
    request = request_from_args(build_parser().parse_args(["submit", "hi", "--max-skips", "0"]))
    assert GenerationRequest.parse_payload(request).max_skips == 0
