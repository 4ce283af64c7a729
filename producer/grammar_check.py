"""Whether an llguidance grammar compiles and starts within llguidance's limits: the gateway's check
of a request's constraint, run in its grammar-check processes (producer/gateway/constraints.py).

This module imports only llguidance, grammar_limits and the standard library, so a check process
starts fast. The check is CPU work, much of it pure Python (llguidance converts GBNF to Lark in
Python, in time quadratic in the rules: 2,000 rules take 11 s), so it cannot share the gateway's
event loop, nor a thread of its process (the GIL). It is bounded in time by an interval timer
(SIGALRM, in the check process's main thread, where ProcessPoolExecutor runs it) and in size by
llguidance's max_grammar_size. llguidance's limits that only trip once a token is consumed
(max_items_in_row, the lexer's expression fuel) are found by starting a matcher over a byte-level
vocabulary, computing its first mask and consuming the first byte it allows: the model's tokenizer
is the worker's, which checks again with it.
"""

from __future__ import annotations

import signal
from types import FrameType

import llguidance

from grammar_limits import limit_problem

_EOS = 256


class _Bytes:
    """A byte-level vocabulary (256 bytes and an end token), llguidance's TokenizerWrapper shape."""

    eos_token_id = _EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [_EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class _OutOfTime(BaseException):
    """Raised by the interval timer; a BaseException, so that llguidance's `except Exception`
    around its GBNF converter does not swallow it."""


def _out_of_time(signum: int, frame: FrameType | None) -> None:
    raise _OutOfTime


_tokenizer: llguidance.LLTokenizer | None = None


def check_grammar(syntax: str, text: str, timeout_s: float, max_grammar_size: int) -> str | None:
    """Why the grammar llguidance.grammar_from(syntax, text) makes cannot run (one line naming the
    problem or the limit, "constraint: <syntax>: ..."), or None."""
    global _tokenizer
    previous = signal.signal(signal.SIGALRM, _out_of_time)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        if _tokenizer is None:
            _tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
        problem = _problem(syntax, text, _tokenizer, max_grammar_size)
    except _OutOfTime:
        problem = f"checking the grammar took longer than {timeout_s:g} s (grammar_check_timeout_s)"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return None if problem is None else f"constraint: {syntax}: {problem}"


def _problem(syntax: str, text: str, tokenizer: llguidance.LLTokenizer, max_grammar_size: int) -> str | None:
    limits = llguidance.LLParserLimits(max_grammar_size=max_grammar_size, verbose_errors=False)
    try:
        grammar = llguidance.grammar_from(syntax, text)  # type: ignore[arg-type]
    except Exception as error:  # noqa: BLE001 - llguidance's converters raise several kinds on bad input
        return limit_problem(str(error), limits)
    problem = llguidance.LLMatcher.validate_grammar(grammar, limits=limits)
    if problem:
        return limit_problem(problem, limits)
    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=limits, log_level=0)
    mask = matcher.compute_bitmask() if not matcher.is_stopped() else b""
    first = next((b for b in range(min(_EOS, 8 * len(mask))) if mask[b // 8] >> (b % 8) & 1), None)
    if first is not None and not matcher.is_error():
        matcher.consume_token(first)
        if not matcher.is_error() and not matcher.is_stopped():
            matcher.compute_bitmask()
    return limit_problem(matcher.get_error(), limits) if matcher.is_error() else None
