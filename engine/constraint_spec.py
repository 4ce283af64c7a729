"""What a job's output must match (a JSON Schema, any JSON object, a regular expression, a list of
choices, a Lark or GBNF grammar): a plain, hashable description. Compiling and matching it is
engine/constraints.py's work, so a job carries a constraint without importing the grammar engine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]


@dataclass(frozen=True)
class Constraint:
    """What a job's output must match; build one with the class methods."""

    kind: ConstraintKind
    source: str  # the schema as JSON, the pattern, the choices as a JSON list, or the grammar text

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice: needs at least one option, each a non-empty string")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str, syntax: Literal["lark", "gbnf"] = "lark") -> Constraint:
        return cls(syntax, text)
