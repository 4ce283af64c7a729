"""A grammar must not freeze the engine loop (issue 23, items 4 and 5): a hostile constraint
(a JSON Schema of 1,900 alternatives, the regex `(a{n}){n}`) starts on the compile
threads while a canary job streams, the canary's longest pause between steps stays under
100 ms, and the hostile job then runs (or fails alone within its compile budget); a grammar
past one of llguidance's limits fails its job with one line naming the limit."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from engine import Constraint, EngineOutput, FinishReason, Generator, Job
from engine.constraints import MAX_ERROR_CHARS
from engine.engine_config import ConstraintBudget
from worker.settings import Settings

LONGEST_PAUSE_S = 0.1
"""The issue's bound on the engine loop's longest pause while a hostile request is admitted."""
ROUNDS = 3
"""This 2-core machine's other load alone pauses a loop now and then for over 100 ms, so a
hostile start is tried up to three times (each a grammar not started before: started grammars
are cached) and one must stay under the bound; a pause the grammar causes shows in all."""
NESTED_REGEX = "(a{1000}){1000}"


def big_schema(round_: int) -> dict:
    """Takes about half a second to start here (1,900 alternatives of 4-property objects; 1,900
    stays under llguidance's max_items_in_row, more properties pass its schema size limit)."""
    return {"anyOf": [{"type": "object", "properties": {f"p{round_}_{i}_{j}": {"type": "integer"} for j in range(4)},
                       "required": [f"p{round_}_{i}_{j}" for j in range(4)], "additionalProperties": False}
                      for i in range(1900)]}


@pytest.fixture(scope="module")
def generator(tiny_model_factory: Callable[..., Path]) -> Generator:
    return Generator.from_pretrained(tiny_model_factory("llama"), cache_tokens=8192, page_size=16, max_batch_size=8)


def canary_pauses(generator: Generator, hostile: Job, canary_tokens: int = 400
                  ) -> tuple[float, float, dict[object, EngineOutput]]:
    """Run a canary beside the hostile job: the longest time between two iterate() calls that gave
    the canary tokens while the hostile job was being admitted (its grammar starting), how long
    that took, and every job's final output."""
    canary = Job([5, 6, 7], canary_tokens, stop_conditions=[], identifier="canary")
    generator.enqueue(canary)
    while not any(r.identifier == "canary" and r.token_ids for r in generator.iterate()):
        pass
    generator.enqueue(hostile)
    admitting = last = started = time.perf_counter()
    longest = 0.0
    finals: dict[object, EngineOutput] = {}
    while generator.num_remaining_jobs():
        pending = generator.num_pending_jobs() > 0
        results = generator.iterate()
        now = time.perf_counter()
        if pending:
            admitting = now
        if any(r.identifier == "canary" and r.token_ids for r in results):
            if pending:
                longest = max(longest, now - last)
            last = now
        finals.update({r.identifier: r for r in results if r.eos})
    assert "canary" in finals and len(finals["canary"].completion_ids or ()) == canary_tokens
    return longest, admitting - started, finals


def test_a_big_json_schema_starts_off_the_loop_and_then_runs(generator: Generator):
    pauses = []
    for round_ in range(ROUNDS):
        schema = big_schema(round_)
        hostile = Job([8, 9], 200, constraint=Constraint.json_schema(schema), identifier="hostile")
        longest, admitting, finals = canary_pauses(generator, hostile)
        assert admitting > 0.3, admitting  # the schema does take long to start here: several steps' worth
        result = finals["hostile"]
        assert result.eos_reason is FinishReason.CONSTRAINT_COMPLETE, (result.eos_reason, result.error)
        jsonschema.validate(json.loads(result.full_completion or ""), schema)
        pauses.append(longest)
        if longest < LONGEST_PAUSE_S:
            break
    assert min(pauses) < LONGEST_PAUSE_S, f"the canary paused {', '.join(f'{p:.3f}' for p in pauses)} s"


def test_a_nested_regex_over_its_compile_budget_fails_alone(generator: Generator):
    generator.setup.budget = ConstraintBudget(compile_timeout_s=0.3)
    pauses = []
    try:
        for round_ in range(ROUNDS):
            regex = "b" * round_ + NESTED_REGEX
            longest, _, finals = canary_pauses(generator, Job([8, 9], 20, constraint=Constraint.regex(regex),
                                                              identifier="hostile"))
            error = finals["hostile"].error
            assert finals["hostile"].eos_reason is FinishReason.ERROR
            assert error == "constraint: the grammar took longer than 0.3 s to compile (compile_timeout_s)"
            pauses.append(longest)
            if longest < LONGEST_PAUSE_S:
                break
    finally:
        generator.setup.budget = ConstraintBudget()
    assert min(pauses) < LONGEST_PAUSE_S, f"the canary paused {', '.join(f'{p:.3f}' for p in pauses)} s"


def test_a_grammar_past_an_llguidance_limit_fails_with_one_line_naming_it(generator: Generator):
    wide = "start: " + " | ".join(f'"a{i}"' for i in range(3000))
    finals = {}
    generator.enqueue([Job([8, 9], 10, constraint=Constraint.grammar(wide), identifier="wide"),
                       Job([8, 9], 10, constraint=Constraint.choice(["yes", "no"]), identifier="fine")])
    while generator.num_remaining_jobs():
        finals.update({r.identifier: r for r in generator.iterate() if r.eos})
    error = finals["wide"].error
    assert finals["wide"].eos_reason is FinishReason.ERROR and error is not None
    assert error.startswith("constraint: lark: over llguidance's max_items_in_row limit (2000)"), error
    assert "\n" not in error and len(error) <= MAX_ERROR_CHARS
    assert finals["fine"].full_completion in ("yes", "no")


def test_the_compile_budget_is_an_engine_option_and_a_worker_setting():
    config = Settings(model="m", compile_timeout_s=2.5, max_grammar_size=1234).engine_config()
    assert config.constraints == ConstraintBudget(compile_timeout_s=2.5, max_grammar_size=1234)
