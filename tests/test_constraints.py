"""Constrained decoding (engine/constraints.py): every sampled output of a
constrained job matches its JSON Schema (checked with jsonschema), regex or
choice list; Lark and GBNF grammars hold; a finished constraint ends the job;
constraints compose with the prefix cache and speculation; a bad constraint
fails its job alone, naming the problem, while other jobs run on (grammars
start off the engine loop, so the problem is found after enqueue)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from engine import Constraint, FinishReason, Generator, Job, SamplerSettings
from engine.constraints import compiled_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bc", "def"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2,3}-[0-9]{2,4}(-(alpha|beta))?"
CHOICES = ["positive", "negative", "neutral", "no opinion"]
SAMPLED = SamplerSettings(temperature=1.0)


@pytest.fixture(scope="module")
def generator(tiny_model_factory: Callable[..., Path]) -> Generator:
    return Generator.from_pretrained(tiny_model_factory("llama"), cache_tokens=16384, page_size=16,
                                     max_batch_size=128)


def run(generator: Generator, jobs: list[Job]) -> dict[object, dict]:
    for job in jobs:
        generator.enqueue(job)
    finals: dict[object, dict] = {}
    texts: dict[object, str] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            texts[result.identifier] = texts.get(result.identifier, "") + result.text
            if result.eos:
                finals[result.identifier] = {"text": result.full_completion, "reason": result.eos_reason,
                                             "ids": list(result.completion_ids), "error": result.error}
    assert all(finals[i]["text"] == texts[i] for i in finals)
    return finals


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(3, 24))] for _ in range(count)]


def test_200_sampled_completions_under_a_nested_json_schema_all_validate(generator: Generator):
    constraint = Constraint.json_schema(SCHEMA)
    jobs = [Job(prompt, 200, constraint=constraint, gen_settings=SAMPLED, seed=i, identifier=i)
            for i, prompt in enumerate(prompts(200))]
    finals = run(generator, jobs)
    assert len(finals) == 200
    for final in finals.values():
        jsonschema.validate(json.loads(final["text"]), SCHEMA)
        assert final["reason"] is FinishReason.CONSTRAINT_COMPLETE
    assert len({f["text"] for f in finals.values()}) > 100  # sampled, not one forced answer
    stats = generator.stats  # masks were computed in the background of the forwards
    # (a job's first mask is the grammar's, computed once as it starts and shared by the 200 jobs)
    assert stats.constraint_masks >= sum(len(f["ids"]) - 1 for f in finals.values())
    assert 0 < stats.constraint_mask_wait_s <= stats.constraint_mask_s + 0.5


def test_200_sampled_completions_match_a_regex_and_a_choice_list(generator: Generator):
    jobs = [Job(prompt, 40, constraint=Constraint.regex(REGEX), gen_settings=SAMPLED, seed=i, identifier=("re", i))
            for i, prompt in enumerate(prompts(100, seed=1))]
    jobs += [Job(prompt, 40, constraint=Constraint.choice(CHOICES), gen_settings=SAMPLED, seed=i,
                 identifier=("choice", i)) for i, prompt in enumerate(prompts(100, seed=2))]
    finals = run(generator, jobs)
    for (kind, _), final in finals.items():
        if kind == "re":
            assert re.fullmatch(REGEX, final["text"]), final
        else:
            assert final["text"] in CHOICES, final
    assert {f["text"] for (kind, _), f in finals.items() if kind == "choice"} == set(CHOICES)


def test_lark_and_gbnf_grammars_hold(generator: Generator):
    lark = Constraint.grammar('start: "(" NUMBER ")" | "(" NUMBER "+" NUMBER ")"\nNUMBER: /[1-9][0-9]?/')
    gbnf = Constraint.grammar('root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= [a-c] [0-9]', syntax="gbnf")
    patterns = {"lark": r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", "gbnf": r"\[[a-c][0-9](,[a-c][0-9]){0,2}\]"}
    jobs = [Job(prompt, 60, constraint=lark if i % 2 else gbnf, gen_settings=SAMPLED, seed=i,
                identifier=("lark" if i % 2 else "gbnf", i)) for i, prompt in enumerate(prompts(40, seed=3))]
    for (syntax, _), final in run(generator, jobs).items():
        assert re.fullmatch(patterns[syntax], final["text"]), (syntax, final)
        assert final["reason"] is FinishReason.CONSTRAINT_COMPLETE


def test_a_constraint_with_the_model_s_eos_allowed_may_stop_on_it(generator: Generator):
    """Where the grammar may end but also go on (a regex with an optional tail), the job's stop
    tokens are allowed exactly when the grammar allows its end."""
    eos = generator.tokenizer.eos_token_id
    jobs = [Job(prompt, 40, constraint=Constraint.regex("ab(c)*"), gen_settings=SAMPLED, seed=i, identifier=i,
                stop_conditions=[eos]) for i, prompt in enumerate(prompts(30, seed=4))]
    for final in run(generator, jobs).values():
        assert re.fullmatch("ab(c)*", final["text"]), final
        assert final["reason"] in (FinishReason.STOP_TOKEN, FinishReason.MAX_NEW_TOKENS)
        if final["reason"] is FinishReason.STOP_TOKEN:
            assert final["ids"][-1] == eos


def test_constraints_give_the_same_greedy_output_with_prefix_cache_and_speculation(
    tiny_model_factory: Callable[..., Path]
):
    model = tiny_model_factory("llama")
    shared = prompts(1, seed=5)[0] * 3
    jobs = lambda: [Job(shared + tail, 80, constraint=Constraint.json_schema(SCHEMA), identifier=i)  # noqa: E731
                    for i, tail in enumerate(prompts(6, seed=6))]
    plain = run(Generator.from_pretrained(model, cache_tokens=4096, page_size=8, prefix_caching=False), jobs())
    cached_generator = Generator.from_pretrained(model, cache_tokens=4096, page_size=8)
    cached = run(cached_generator, jobs())
    speculating_generator = Generator.from_pretrained(model, cache_tokens=4096, page_size=8, use_ngram_draft=True)
    speculating = run(speculating_generator, jobs())
    assert cached == plain == speculating
    assert cached_generator.stats.cached_prompt_tokens > 0
    drafted, accepted = speculating_generator.stats.drafted_tokens, speculating_generator.stats.accepted_draft_tokens
    assert drafted > accepted > 0  # drafts were verified under the grammar, some kept and some refused
    for final in plain.values():
        jsonschema.validate(json.loads(final["text"]), SCHEMA)


def test_sampled_constrained_jobs_stay_valid_while_speculating(tiny_model_factory: Callable[..., Path]):
    generator = Generator.from_pretrained(tiny_model_factory("llama"), cache_tokens=8192, page_size=8,
                                          use_ngram_draft=True, max_speculative_batch=64)
    jobs = [Job(prompt * 3, 120, constraint=Constraint.json_schema(SCHEMA), gen_settings=SAMPLED, seed=i,
                identifier=i) for i, prompt in enumerate(prompts(40, seed=7))]
    for final in run(generator, jobs).values():
        jsonschema.validate(json.loads(final["text"]), SCHEMA)
    assert generator.stats.drafted_tokens > 0


@pytest.mark.parametrize(("constraint", "problem"), [
    (Constraint.json_schema('{"type": "nonsense"}'), "nonsense"),
    (Constraint.json_schema("{not json"), "not valid JSON"),
    (Constraint.regex("(unclosed"), "unclosed group"),
    (Constraint.grammar("start: undefined_rule"), "undefined_rule"),
    (Constraint.grammar("root ::= [", syntax="gbnf"), "gbnf"),
])
def test_a_bad_constraint_fails_its_job_alone_naming_the_problem_while_others_run(
    generator: Generator, constraint: Constraint, problem: str
):
    good = Job(prompts(1)[0], 30, constraint=Constraint.choice(CHOICES), identifier="good")
    finals = run(generator, [good, Job(prompts(1)[0], 10, constraint=constraint, identifier="bad")])
    assert finals["bad"]["reason"] is FinishReason.ERROR
    assert re.match(f"constraint: .*{re.escape(problem)}", finals["bad"]["error"]), finals["bad"]["error"]
    assert "\n" not in finals["bad"]["error"]
    assert finals["good"]["text"] in CHOICES


def test_a_compiled_grammar_is_reused_for_the_same_constraint(generator: Generator):
    constraint = Constraint.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}})
    before = compiled_grammar.cache_info()
    run(generator, [Job(prompt, 30, constraint=constraint, identifier=i) for i, prompt in enumerate(prompts(3))])
    after = compiled_grammar.cache_info()
    assert after.misses - before.misses == 1


def test_the_real_model_answers_a_json_question_in_valid_json(smollm2_gguf: Path):
    generator = Generator.from_pretrained(smollm2_gguf, cache_tokens=4096)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    prompt = generator.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France? "
                                                                          "Answer in JSON with city and country."}])
    final = run(generator, [Job(prompt, 60, constraint=Constraint.json_schema(schema), identifier="q")])["q"]
    answer = json.loads(final["text"])
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris" and final["reason"] is FinishReason.CONSTRAINT_COMPLETE
