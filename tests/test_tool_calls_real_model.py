"""Forced tool calls on the real model (SmolLM2-135M-Instruct, whose template has no tool support:
the generic tool prompt, hermes format): every one of 100 sampled calls, at temperature 1, parses
and its arguments validate against the tool's schema. Built with the worker's own build_job and
read with its own result parsing, through the engine directly."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import Generator
from producer.protocol import Choice, GenerationRequest
from worker.events import finish_reason_from_eos
from worker.jobs import build_job
from worker.tool_results import with_tool_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SAMPLES = 100


@pytest.mark.slow
def test_100_sampled_forced_calls_on_smollm2_all_parse_and_validate(smollm2_gguf: Path):
    generator = Generator.from_pretrained(smollm2_gguf, cache_tokens=32768, max_batch_size=SAMPLES)
    requests, jobs = {}, []
    for seed in range(SAMPLES):
        request = GenerationRequest.parse_payload({
            "messages": [{"role": "user", "content": "What is the weather like in Paris this week?"}],
            "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_new_tokens": 96,
            "sampling": {"temperature": 1.0, "seed": seed}})
        identifier = f"call-{seed}"
        requests[identifier] = request
        jobs.append(build_job(request, generator.tokenizer, identifier, generator.model.config.vocab_size))
    generator.enqueue(jobs)
    finals = {}
    while generator.num_remaining_jobs():
        finals.update({out.identifier: out for out in generator.iterate() if out.eos})
    names = set()
    for identifier, out in finals.items():
        choice = Choice(index=0, text=out.full_completion or "", finish_reason=finish_reason_from_eos(out.eos_reason))
        [parsed] = with_tool_calls([choice], requests[identifier], identifier)
        assert parsed.finish_reason == "tool_calls", (identifier, out.full_completion)
        assert parsed.content == "" and parsed.tool_calls is not None and len(parsed.tool_calls) == 1
        call = parsed.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        names.add(call.name)
    assert len(finals) == SAMPLES
    assert names <= set(SCHEMAS)
