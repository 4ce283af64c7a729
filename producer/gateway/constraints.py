"""Checking a request's output constraint at the gateway, before it is queued.

A JSON Schema, regex or grammar that does not compile would fail the request
on the worker; checked here, the caller gets a 400 naming the problem at
once (and a streamed request never starts with 200). The check uses
llguidance, the library the worker's engine constrains decoding with (it
imports no torch), so the two agree; the worker still checks, for producers
that bypass the gateway. Choice lists and "any JSON object" always compile.
"""

from __future__ import annotations

import json

import llguidance

from producer.protocol import GrammarConstraint, JsonSchemaConstraint, OutputConstraint, RegexConstraint


def constraint_problem(constraint: OutputConstraint) -> str | None:
    """Why the constraint cannot be compiled ("constraint: <kind>: <problem>"), or None."""
    if isinstance(constraint, JsonSchemaConstraint):
        kind, syntax, text = "json_schema", "json_schema", json.dumps(constraint.json_schema)
    elif isinstance(constraint, RegexConstraint):
        kind, syntax, text = "regex", "regex", constraint.pattern
    elif isinstance(constraint, GrammarConstraint):
        kind, syntax, text = constraint.syntax, constraint.syntax, constraint.grammar
    else:
        return None
    try:
        problem = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(syntax, text))
    except Exception as error:  # noqa: BLE001 - llguidance's converters raise several kinds on bad input
        problem = str(error)
    if not problem:
        return None
    lines = [line.strip() for line in problem.splitlines()]
    return f"constraint: {kind}: " + "; ".join(line for line in lines if line and set(line) != {"^"})
