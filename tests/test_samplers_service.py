"""exllamav2's further samplers through the service: the wire protocol's sampling fields (each
bad value refused naming the field), the worker's mapping onto the engine's settings (DRY's
sequence breakers and XTC's spared tokens from strings to token ids with the model's
tokenizer), a real `genq worker` serving such requests, and the gateway's OpenAI endpoints
taking them under TabbyAPI's names."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from celery import Celery

from engine import SamplerSettings, Tokenizer
from producer.cli import UsageError, request_from_args
from producer.protocol import (
    DRY_DEFAULT_SEQUENCE_BREAKERS,
    TASK_NAME,
    GenerationRequest,
    GenerationResult,
    ProtocolError,
    SamplingParams,
)
from tests.gateway_service import MODEL, QUEUE, bearer
from worker.cli import build_parser
from worker.jobs import build_job
from worker.processes import WorkerProcess

EVERYTHING = {
    "temperature": 0.9, "repetition_penalty": 1.2, "repetition_penalty_range": 64, "repetition_penalty_decay": 16,
    "dry_multiplier": 0.8, "dry_base": 1.5, "dry_allowed_length": 3, "dry_range": 256,
    "dry_sequence_breakers": ["\n", ":"], "smoothing_factor": 0.2, "tfs": 0.95, "typical": 0.9, "mirostat": True,
    "mirostat_tau": 3.0, "mirostat_eta": 0.2, "temperature_last": True, "min_temp": 0.5, "max_temp": 1.5,
    "temp_exponent": 2.0, "xtc_probability": 0.5, "xtc_threshold": 0.2, "skew": 0.3,
}


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"typical": 0}, "sampling.typical: Input should be greater than 0"),
        ({"tfs": 1.5}, "sampling.tfs: Input should be less than or equal to 1"),
        ({"skew": -11}, "sampling.skew: Input should be greater than or equal to -10"),
        ({"smoothing_factor": -1}, "sampling.smoothing_factor: Input should be greater than or equal to 0"),
        ({"min_temp": 3}, "sampling.min_temp: Input should be less than or equal to 2"),
        ({"min_temp": 1.5, "max_temp": 1.0}, "sampling.max_temp: must be >= min_temp (1.5)"),
        ({"temp_exponent": 0}, "sampling.temp_exponent: Input should be greater than 0"),
        ({"temperature_last": "yes"}, "sampling.temperature_last: Input should be a valid boolean"),
        ({"mirostat": 2}, "sampling.mirostat: Input should be a valid boolean"),
        ({"mirostat_tau": -1}, "sampling.mirostat_tau: Input should be greater than or equal to 0"),
        ({"mirostat_eta": -0.1}, "sampling.mirostat_eta: Input should be greater than or equal to 0"),
        ({"dry_multiplier": -1}, "sampling.dry_multiplier: Input should be greater than or equal to 0"),
        ({"dry_base": 0.5}, "sampling.dry_base: Input should be greater than or equal to 1"),
        ({"dry_allowed_length": 20}, "sampling.dry_allowed_length: Input should be less than or equal to 19"),
        ({"dry_range": -1}, "sampling.dry_range: Input should be greater than or equal to 0"),
        ({"dry_sequence_breakers": ["\n", ""]}, "sampling.dry_sequence_breakers[1]: String should have at least 1"),
        ({"dry_sequence_breakers": "\n"}, "sampling.dry_sequence_breakers: Input should be a valid list"),
        ({"dry_sequence_breakers": ["x"] * 65}, "sampling.dry_sequence_breakers: at most 64 items allowed"),
        ({"xtc_probability": 1.1}, "sampling.xtc_probability: Input should be less than or equal to 1"),
        ({"xtc_threshold": -0.1}, "sampling.xtc_threshold: Input should be greater than or equal to 0"),
        ({"repetition_penalty_range": -2},
         "sampling.repetition_penalty_range: Input should be greater than or equal to -1"),
        ({"repetition_penalty_decay": 1.5}, "sampling.repetition_penalty_decay: Input should be a valid integer"),
    ],
)
def test_each_new_sampling_field_is_validated_naming_it(sampling: dict[str, Any], expected: str):
    with pytest.raises(ProtocolError) as info:
        GenerationRequest.parse_payload({"prompt": "x", "sampling": sampling})
    assert expected in str(info.value)


def test_every_wire_sampling_field_reaches_the_engine(model_dir: Path):
    tokenizer = Tokenizer.from_pretrained(model_dir)
    request = GenerationRequest.parse_payload({"prompt": "x", "sampling": EVERYTHING})
    assert request.to_kwargs()["sampling"] == EVERYTHING  # and round-trips on the wire
    settings = build_job(request, tokenizer, "id", tokenizer.vocab_size).gen_settings
    engine_fields = {f.name for f in dataclasses.fields(SamplerSettings)}
    for name, value in EVERYTHING.items():
        if name != "dry_sequence_breakers":
            assert getattr(settings, name) == value, name
    unmapped = set(SamplingParams.model_fields) - engine_fields - {"seed"}
    assert not unmapped, f"wire sampling fields with no engine setting: {unmapped}"
    texts = {t: tokenizer.decode([t], skip_special_tokens=False) for t in range(tokenizer.vocab_size)}
    assert settings.dry_sequence_breakers == tuple(t for t, text in texts.items() if "\n" in text or ":" in text)
    assert settings.dry_sequence_breakers  # the tiny tokenizer has newline tokens
    assert set(tokenizer.eos_token_ids) <= set(settings.xtc_ignore_tokens)
    assert {t for t, text in texts.items() if "\n" in text} <= set(settings.xtc_ignore_tokens)


def test_dry_breakers_default_to_exllamav2_s_and_an_empty_list_means_none(model_dir: Path):
    tokenizer = Tokenizer.from_pretrained(model_dir)

    def breakers(sampling: dict[str, Any]) -> tuple[int, ...]:
        request = GenerationRequest.parse_payload({"prompt": "x", "sampling": sampling})
        return build_job(request, tokenizer, "id", tokenizer.vocab_size).gen_settings.dry_sequence_breakers

    default = set(breakers({"dry_multiplier": 1.0}))
    assert tokenizer.special_token_ids <= default
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in range(tokenizer.vocab_size)]
    assert {t for t, text in enumerate(texts) if any(c in text for c in DRY_DEFAULT_SEQUENCE_BREAKERS)} <= default
    assert breakers({"dry_multiplier": 1.0, "dry_sequence_breakers": []}) == ()
    assert breakers({"dry_sequence_breakers": ["\n"]}) == ()  # DRY off: nothing to map


def test_the_cli_sends_any_sampling_setting_as_json():
    parser = build_parser()
    args = parser.parse_args(["submit", "hi", "--sampling", '{"mirostat": true, "temperature": 0.2}', "--temperature",
                              "0.7"])
    assert request_from_args(args)["sampling"] == {"mirostat": True, "temperature": 0.7}  # the option wins
    for bad in ("[1]", "{mirostat"):
        with pytest.raises(UsageError, match="--sampling"):
            request_from_args(parser.parse_args(["submit", "hi", "--sampling", bad]))


def test_a_real_worker_serves_dry_xtc_and_mirostat_requests(worker: WorkerProcess, celery_client: Celery):
    def send(identifier: str, sampling: dict[str, Any], **request: Any) -> GenerationResult:
        request = request or {"prompt": "the cat sat on the mat. the cat sat on the"}
        handle = celery_client.send_task(TASK_NAME, queue=QUEUE, kwargs={
            "max_new_tokens": 12, "ignore_eos": True, "identifier": identifier, "sampling": sampling, **request})
        return GenerationResult.from_dict(handle.get(timeout=120))

    seeded = {**EVERYTHING, "seed": 11}
    first, again = send("exl2-a", seeded), send("exl2-b", seeded)
    assert first.finish_reason == "length" and first.usage.completion_tokens == 12 and first.text
    assert again.text == first.text  # seeded: the same request gives the same text
    # Between tokens 10 and 11, a bias makes greedy decoding take 11; after "10 11 10 11 10", DRY
    # penalises 11 (it followed "10 11 10" before) far more than the bias, so the first token is 10.
    loop = {"temperature": 0.0, "allowed_token_ids": [10, 11], "token_bias": {"11": 20.0}}
    dry = {**loop, "dry_multiplier": 100.0, "dry_sequence_breakers": []}
    plain, steered = (send(f"exl2-{name}", sampling, input_ids=[10, 11, 10, 11, 10])
                      for name, sampling in (("plain", loop), ("dry", dry)))
    assert plain.token_ids[0] == 11 and steered.token_ids[0] == 10


def test_the_gateway_takes_them_under_tabbyapi_s_names(oai: openai.OpenAI, gateway: str):
    extra = {"top_a": 0.1, "typical_p": 0.9, "tfs": 0.95, "skew": 0.2, "smoothing_factor": 0.3, "min_temp": 0.5,
             "max_temp": 1.5, "temp_exponent": 1.0, "temperature_last": True, "mirostat_mode": 2,
             "mirostat_tau": 3.0, "mirostat_eta": 0.1, "dry_multiplier": 0.8, "dry_base": 1.75,
             "dry_allowed_length": 2, "dry_range": 128, "dry_sequence_breakers": '"\\n", ":"',
             "xtc_probability": 0.5, "xtc_threshold": 0.1, "penalty_range": 32, "repetition_decay": 8,
             "repetition_penalty": 1.1, "ignore_eos": True}
    reply = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=2,
                                   extra_body=extra)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    for body, problem in (({"mirostat_mode": 1}, "mirostat_mode: 0 (off) or 2 (mirostat v2), got 1"),
                          ({"dry_sequence_breakers": "[\"\\n\""}, "dry_sequence_breakers: not a JSON array"),
                          ({"penalty_range": -5}, "penalty_range: Input should be greater than or equal to -1"),
                          ({"xtc_threshold": 2}, "xtc_threshold: Input should be less than or equal to 1")):
        refused = httpx.post(f"{gateway}/v1/completions", headers=bearer(), timeout=30,
                             json={"model": MODEL, "prompt": "x", "max_tokens": 2, **body})
        assert refused.status_code == 400, refused.text
        assert problem in refused.json()["error"]["message"], refused.json()
