"""llguidance's errors as one line, naming the parser limit that tripped: the one copy the engine
(a job's grammar, engine/constraints.py) and the gateway's grammar check (producer/grammar_check.py)
report with. A floor below both, as chat_template/ is: it imports only llguidance, so the engine
(which may not import producer) and the torch-free producer can share it."""

from __future__ import annotations

import llguidance

MAX_ERROR_CHARS = 200
"""A constraint's error is one line of at most this many characters."""
_LIMIT_MESSAGES = (
    ("Current row has", "max_items_in_row"),
    ("Too many items", "step_max_items"),
    ("grammar size (number of symbols) too big", "max_grammar_size"),
    ("initial lexer configuration (grammar) too big", "initial_lexer_fuel"),
    ("lexer precomputation failed", "initial_lexer_fuel"),
    ("too many expressions constructed", "initial_lexer_fuel"),
    ("fuel exhausted", "step_lexer_fuel"),
    ("derivatives with total fuel", "step_lexer_fuel"),
)
"""llguidance's message when a parser limit trips -> the LLParserLimits field that did."""


def limit_problem(error: str, limits: llguidance.LLParserLimits | None = None) -> str:
    """llguidance's error as one line (no caret lines, no parser dump); a parser limit that
    tripped is named with its value in `limits` (llguidance's defaults if not given)."""
    lines = [line.strip() for line in error.replace("<non-verbose/>", "").splitlines()]
    line = "; ".join(line for line in lines if line and set(line) != {"^"})
    for message, name in _LIMIT_MESSAGES:
        if message in line:
            value = getattr(limits or llguidance.LLParserLimits(), name)
            line = f"over llguidance's {name} limit ({value}): {line}"
            break
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."
