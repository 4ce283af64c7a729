"""Constrained decoding: a job's output held to a JSON Schema, any JSON
object, a regular expression, a list of choices or a context-free grammar
(Lark, or llama.cpp's GBNF), as exllamav2's filters and vLLM's guided
decoding do.

The grammar work is llguidance's. bench/grammar_libraries.py measured it
against xgrammar on SmolLM2's 49,152-token vocabulary: both refused no valid
token and allowed no invalid one; xgrammar's mask is faster (4.7 vs 16.5 µs
per JSON token, mean), but llguidance imports neither torch nor transformers
(xgrammar imports both), so the torch-free gateway can check a grammar with
the same library the worker runs, and it reads Lark and GBNF directly. At
16.5 µs a row, a batch of 64 constrained jobs costs about 1 ms of CPU per
step.

A job's ConstraintState advances its matcher when a step's tokens are
appended and then computes the next mask on a background thread while the
next forward runs (exllamav2's filter_background_eval); a job whose grammar
admits nothing but the end stops at once with eos_reason
"constraint_complete" instead of spending a forward on a forced EOS
(exllamav2's filter_prefer_eos). Grammars are compiled once per
(constraint, tokenizer) and cached.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import llguidance
import llguidance.torch
import torch

from engine.errors import JobRejected

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]
GRAMMAR_CACHE_SIZE = 256
MASK_THREADS = 1
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
"""Row b: the 8 bits of byte value b, lowest first."""


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

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar; ValueError naming what is wrong."""
        if self.kind in ("json_schema", "json_object"):
            syntax, text = "json_schema", _compact(self.source if self.kind == "json_schema" else '{"type": "object"}')
        else:
            syntax, text = self.kind, self.source
        try:
            grammar = llguidance.grammar_from(syntax, text)
        except Exception as error:  # noqa: BLE001 - the GBNF converter raises several kinds on bad input
            raise ValueError(f"{self.kind}: {_one_line(str(error))}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise ValueError(f"{self.kind}: {_one_line(problem)}")
        return grammar


@dataclass
class MaskTimes:
    """Where constraint masks cost time: computing them (on the mask thread) and waiting for
    them (the part left on a step's critical path, in the sampler)."""

    computed_s: float = 0.0
    waited_s: float = 0.0
    masks: int = 0


class ConstraintCompiler:
    """A tokenizer's llguidance view, and the grammars compiled for it (cached)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self.times = MaskTimes()
        # Masks are computed here while the model's forward runs (llguidance releases the GIL).
        self.pool = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="genq-masks")

    def start(self, grammar: str, stop_token_ids: frozenset[int]) -> ConstraintState:
        """A fresh matcher for one job, on a grammar check_constraint() returned."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise JobRejected(f"constraint: {matcher.get_error()}")
        return ConstraintState(matcher, self.vocab_size, self.eos_token_id, stop_token_ids, self.pool, self.times)


def _one_line(problem: str) -> str:
    """llguidance's multi-line diagnostics (with caret lines) as one line for an error message."""
    lines = [line.strip() for line in problem.splitlines()]
    return "; ".join(line for line in lines if line and set(line) != {"^"})


def _compact(schema: str) -> str:
    """The schema with compact JSON output (no whitespace between tokens: a model cannot
    spend its tokens on blank space), unless it sets llguidance's own x-guidance options."""
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as error:
        raise ValueError(f"json_schema: not valid JSON ({error})") from None
    if isinstance(parsed, dict) and "x-guidance" not in parsed:
        parsed = {**parsed, "x-guidance": {"whitespace_flexible": False}}
    return json.dumps(parsed)


def check_constraint(constraint: Constraint) -> str:
    """The constraint's grammar (cached); JobRejected naming the problem when it does not compile."""
    try:
        return compiled_grammar(constraint)
    except ValueError as error:
        raise JobRejected(f"constraint: {error}") from None


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def compiled_grammar(constraint: Constraint) -> str:
    """The constraint's llguidance grammar, checked (ValueError naming the problem); cached."""
    return constraint.llguidance_grammar()


class ConstraintState:
    """One job's matcher and the tokens it allows next. After each step's tokens
    are consumed, the next mask is computed on the mask thread, in the background
    of the next forward (exllamav2's filter_background_eval); the sampler waits
    for it only if it is not ready yet. The grammar's own end (llguidance's EOS
    token, allowed once the output may end) becomes the job's stop tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int | None,
                 stop_token_ids: frozenset[int], pool: ThreadPoolExecutor, times: MaskTimes) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id if eos_token_id is not None and 0 <= eos_token_id < vocab_size else None
        self.stop_token_ids = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        self.pool = pool
        self.times = times
        self.bitmask_words = (vocab_size + 31) // 32
        self.complete = matcher.is_stopped()
        self._mask: torch.Tensor | Future[torch.Tensor] = self._compute()

    def packed_mask(self) -> torch.Tensor:
        """[ceil(vocab / 32)] int32: bit t of the mask says whether token t may come next
        (llguidance's EOS bit meaning "the output may end here"); unpack_masks() reads it."""
        if isinstance(self._mask, Future):
            started = time.perf_counter()
            self._mask = self._mask.result()
            self.times.waited_s += time.perf_counter() - started
        return self._mask

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past the tokens a step appended (a stop token ends the job and is not consumed),
        then start computing the next mask."""
        stops = set(self.stop_token_ids)
        self.packed_mask()  # the mask thread must not read the matcher while it moves
        for token in tokens:
            if token in stops:
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constraint: token {token} was sampled but the grammar refuses it "
                                   f"({self.matcher.get_error()})")
        self.complete = self.matcher.is_stopped()
        if not self.complete:
            self._mask = self.pool.submit(self._compute)

    def valid_prefix(self, draft: Sequence[int]) -> list[int]:
        """The longest start of a speculative draft the grammar accepts (stop tokens end it)."""
        self.packed_mask()
        stops = set(self.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        cut = next((i for i, token in enumerate(draft) if token in stops), len(draft))
        accepted = self.matcher.try_consume_tokens(list(draft[:cut]))
        self.matcher.rollback(accepted)
        return list(draft[:accepted])

    def draft_masks(self, draft: Sequence[int]) -> torch.Tensor:
        """[len(draft) + 1, vocab] bool: what may be sampled at each verify position (after
        none, one, ... all of the draft's tokens); the matcher is rolled back after."""
        packed = [self.packed_mask()]
        for token in draft:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constraint: draft token {token} is not a valid continuation")
            packed.append(self._compute())
        self.matcher.rollback(len(draft))
        return _unpack(torch.stack(packed), [self.stop_token_ids] * len(packed), self.eos_token_id, self.vocab_size)

    def _compute(self) -> torch.Tensor:
        started = time.perf_counter()
        bitmask = torch.zeros(1, self.bitmask_words, dtype=torch.int32)
        if not self.matcher.is_stopped():
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        elif self.eos_token_id is not None:
            bitmask[0, self.eos_token_id // 32] = 1 << (self.eos_token_id % 32)
        self.times.computed_s += time.perf_counter() - started
        self.times.masks += 1
        return bitmask[0]


def unpack_masks(states: Sequence[ConstraintState], vocab_size: int) -> torch.Tensor:
    """[R, vocab] bool: what each job may sample next, from the states' packed masks, unpacked in one
    batched operation; where a grammar may end (its EOS bit), the job's own stop tokens are allowed."""
    packed = torch.stack([state.packed_mask() for state in states])
    return _unpack(packed, [state.stop_token_ids for state in states], states[0].eos_token_id, vocab_size)


def _unpack(packed: torch.Tensor, stops: Sequence[Sequence[int]], eos: int | None, vocab_size: int) -> torch.Tensor:
    # Little-endian words: byte k of a row is bits 8k..8k+7, so a byte -> 8 bools table unpacks it.
    allowed = _BYTE_BITS[packed.view(torch.uint8).long()].reshape(packed.shape[0], -1)[:, :vocab_size]
    if eos is None:
        return allowed
    may_end = allowed[:, eos].clone()
    allowed[:, eos] = False
    rows = [row for row, ids in enumerate(stops) for _ in ids]
    if rows:
        allowed[rows, [token for ids in stops for token in ids]] = may_end[rows]
    return allowed
