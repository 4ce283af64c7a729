"""Typed engine outputs keep the exllamav2 dict shape readable."""

from __future__ import annotations

import json
from pathlib import Path

from engine import EngineOutput, FinishReason, Generator, Job, Stage

STREAMING_KEYS = {"job", "serial", "identifier", "stage", "eos", "text", "token_ids"}


def test_results_are_typed_and_read_as_the_dicts_they_were(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=512, page_size=8)
    generator.enqueue(Job(generator.tokenizer.encode("Hello there"), 6, stop_conditions=[], identifier="a"))
    results: list[EngineOutput] = []
    while generator.num_remaining_jobs():
        results += generator.iterate()
    assert all(isinstance(r, EngineOutput) for r in results)
    assert results[0].stage is Stage.STARTED and results[0]["stage"] == "started"
    streaming = [r for r in results if r.stage is Stage.STREAMING]
    assert streaming and all(set(r.as_dict()) == STREAMING_KEYS for r in streaming)
    assert "eos_reason" not in streaming[0] and streaming[0].get("eos_reason", "absent") == "absent"
    final = results[-1]
    assert final.eos and final["eos_reason"] == "max_new_tokens" and final.eos_reason is FinishReason.MAX_NEW_TOKENS
    shape = final.as_dict()
    assert "eos_string" not in shape and "eos_token_id" not in shape
    assert shape["new_tokens"] == 6 == len(shape["completion_ids"])
    assert json.loads(json.dumps({k: v for k, v in shape.items() if k != "job"}))["eos_reason"] == "max_new_tokens"


def test_the_trigger_key_is_present_only_for_its_reason(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=512, page_size=8)
    prompt = generator.tokenizer.encode("Hello there")
    plain = Job(prompt, 4, stop_conditions=[])
    generator.enqueue(plain)
    first = None
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r.stage is Stage.STREAMING and first is None:
                first = r.token_ids[0]
    stopped = Job(prompt, 4, stop_conditions=[first])
    generator.enqueue(stopped)
    final = None
    while generator.num_remaining_jobs():
        final = next((r for r in generator.iterate() if r.eos), final)
    assert final is not None and final.eos_reason is FinishReason.STOP_TOKEN
    assert final["eos_token_id"] == first and "eos_string" not in final
