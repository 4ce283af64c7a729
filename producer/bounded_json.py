"""JSON carried inside a string field (an OpenAI `guided_json` schema, TabbyAPI's
`dry_sequence_breakers`), parsed only after its nesting depth and the length of its numbers are
checked. Python's json module recurses once per nesting level and converts numbers with int(),
so a value nested 5,000 deep or holding a 5,000-digit number raised RecursionError or ValueError
deep inside the parser: a 500 instead of a 400 naming the limit."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 64
"""Arrays and objects inside one another; a JSON Schema nests a few levels per property level."""
MAX_JSON_NUMBER_CHARS = 100
"""Characters of one number literal (digits, sign, point, exponent)."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")
_LONG_NUMBER = re.compile(rf"[-+0-9.eE]{{{MAX_JSON_NUMBER_CHARS + 1},}}")


class JsonLimitError(ValueError):
    """The text is nested deeper, or holds a longer number, than the limits allow; the message names the limit."""


def loads_bounded(text: str) -> Any:
    """json.loads(text), refusing (JsonLimitError) nesting deeper than MAX_JSON_DEPTH and number
    literals longer than MAX_JSON_NUMBER_CHARS before the parser sees them; json.JSONDecodeError
    for text that is not JSON."""
    outside_strings = _STRING.sub('""', text)
    depth = 0
    for bracket in _BRACKET.finditer(outside_strings):
        depth += 1 if bracket.group() in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            raise JsonLimitError(f"nested more than {MAX_JSON_DEPTH} arrays or objects deep")
    if _LONG_NUMBER.search(outside_strings):
        raise JsonLimitError(f"holds a number of more than {MAX_JSON_NUMBER_CHARS} characters")
    return json.loads(text)
