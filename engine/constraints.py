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

Starting a grammar can take seconds (a 5,400-property JSON Schema builds its matcher in about
2 s; the regex `(a{1000}){1000}` spends as long on its first mask), so PreparingJobs starts it on
the compile threads, never on the engine loop: llguidance releases the GIL while it builds a
matcher and computes a mask (bench: a Python thread beside it is never held up more than
25 ms), so a thread is enough here. The job joins the scheduler when its matcher and first mask
are ready, within a ConstraintBudget. llguidance's parser limits (LLParserLimits) are checked
at the start too: the first token is tried on a copy of the matcher, because some limits
(max_items_in_row, the lexer's expression fuel) only trip once a token is consumed, and a limit
that trips is reported as one line naming it (verbose_errors off: never the parser's state dump).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import llguidance
import llguidance.torch
import torch

from engine.constraint_spec import Constraint
from engine.engine_config import ConstraintBudget
from engine.errors import JobRejected
from grammar_limits import MAX_ERROR_CHARS as MAX_ERROR_CHARS  # re-exported: the length a job's error keeps to
from grammar_limits import limit_problem

GRAMMAR_CACHE_SIZE = 256
MATCHER_CACHE_SIZE = 64
MASK_THREADS = 1
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
"""Row b: the 8 bits of byte value b, lowest first."""


@dataclass
class MaskTimes:
    """Where constraint masks cost time: computing them (on the mask thread) and waiting for
    them (the part left on a step's critical path, in the sampler)."""

    computed_s: float = 0.0
    waited_s: float = 0.0
    masks: int = 0


def parser_limits(budget: ConstraintBudget) -> llguidance.LLParserLimits:
    """llguidance's limits for a budget: its max_grammar_size; the others keep llguidance's defaults."""
    return llguidance.LLParserLimits(max_grammar_size=budget.max_grammar_size, verbose_errors=False)


@dataclass(frozen=True)
class _Started:
    """A grammar's pristine matcher and its first mask, shared by the jobs that start it (each
    takes a deep copy of the matcher)."""

    matcher: llguidance.LLMatcher
    first_mask: torch.Tensor


class ConstraintCompiler:
    """A tokenizer's llguidance view, and the grammars started for it (cached)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self.mask_eos = _in_vocab(eos_token_id, vocab_size)
        self.times = MaskTimes()
        # Masks are computed here while the model's forward runs (llguidance releases the GIL).
        self.pool = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="genq-masks")
        self._started: OrderedDict[tuple[Constraint, ConstraintBudget], Future[_Started]] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, constraint: Constraint, stop_token_ids: frozenset[int], budget: ConstraintBudget
              ) -> ConstraintState:
        """A fresh matcher for one job, its first mask computed (slow for a large grammar: call it
        off the engine loop); JobRejected, one line, when the grammar does not compile or trips
        one of llguidance's limits on its first token. A grammar is started once (its failure
        too): jobs starting it meanwhile wait for that start, and later ones copy its matcher."""
        key = (constraint, budget)
        with self._lock:
            entry = self._started.get(key)
            owner = entry is None
            if entry is None:
                entry = self._started[key] = Future()
                while len(self._started) > MATCHER_CACHE_SIZE:
                    self._started.popitem(last=False)
            else:
                self._started.move_to_end(key)
        if owner:
            try:
                entry.set_result(self._start(constraint, budget))
            except BaseException as error:
                entry.set_exception(error)
        started = entry.result()
        return ConstraintState(started.matcher.deep_copy(), self.vocab_size, self.eos_token_id, stop_token_ids,
                               self.pool, self.times, started.first_mask)

    def _start(self, constraint: Constraint, budget: ConstraintBudget) -> _Started:
        grammar = check_constraint(constraint)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=parser_limits(budget), log_level=0)
        first_mask = _fill_mask(matcher, self.mask_eos, (self.vocab_size + 31) // 32)
        probe = matcher.deep_copy()
        allowed = _unpack(first_mask[None], [[]], None, self.vocab_size)[0].nonzero().flatten().tolist()
        first = next((t for t in allowed if t != self.mask_eos), None)
        if first is not None and not matcher.is_error():
            probe.consume_token(first)
            _fill_mask(probe, self.mask_eos, first_mask.shape[0])
        for tried in (matcher, probe):
            if tried.is_error():
                raise JobRejected(f"constraint: {constraint.kind}: "
                                  f"{limit_problem(tried.get_error(), parser_limits(budget))}")
        return _Started(matcher, first_mask)


def _in_vocab(token: int | None, vocab_size: int) -> int | None:
    return token if token is not None and 0 <= token < vocab_size else None


def _fill_mask(matcher: llguidance.LLMatcher, eos_token_id: int | None, words: int) -> torch.Tensor:
    """[words] int32: the matcher's next-token mask (only the EOS bit once it has stopped)."""
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    if not matcher.is_stopped():
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    elif eos_token_id is not None:
        bitmask[0, eos_token_id // 32] = 1 << (eos_token_id % 32)
    return bitmask[0]


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
    """The constraint as an llguidance grammar, checked (ValueError naming what is wrong); cached."""
    kind = constraint.kind
    syntax: llguidance.GrammarFormat
    if kind == "json_schema" or kind == "json_object":
        source = constraint.source if kind == "json_schema" else '{"type": "object"}'
        syntax, text = "json_schema", _compact(source)
    else:
        syntax, text = kind, constraint.source
    try:
        grammar = llguidance.grammar_from(syntax, text)
    except Exception as error:  # noqa: BLE001 - the GBNF converter raises several kinds on bad input
        raise ValueError(f"{constraint.kind}: {limit_problem(str(error))}") from None
    limits = parser_limits(ConstraintBudget())
    problem = llguidance.LLMatcher.validate_grammar(grammar, limits=limits)
    if problem:
        raise ValueError(f"{constraint.kind}: {limit_problem(problem, limits)}")
    return grammar


class ConstraintState:
    """One job's matcher and the tokens it allows next. After each step's tokens
    are consumed, the next mask is computed on the mask thread, in the background
    of the next forward (exllamav2's filter_background_eval); the sampler waits
    for it only if it is not ready yet. The grammar's own end (llguidance's EOS
    token, allowed once the output may end) becomes the job's stop tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int | None,
                 stop_token_ids: frozenset[int], pool: ThreadPoolExecutor, times: MaskTimes,
                 first_mask: torch.Tensor) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = _in_vocab(eos_token_id, vocab_size)
        self.stop_token_ids = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        self.pool = pool
        self.times = times
        self.bitmask_words = (vocab_size + 31) // 32
        self.complete = matcher.is_stopped()
        self._mask: torch.Tensor | Future[torch.Tensor] = first_mask

    def packed_mask(self) -> torch.Tensor:
        """[ceil(vocab / 32)] int32: bit t of the mask says whether token t may come next
        (llguidance's EOS bit meaning "the output may end here"); unpack_masks() reads it."""
        if isinstance(self._mask, Future):
            started = time.perf_counter()
            self._mask = self._mask.result()
            self.times.waited_s += time.perf_counter() - started
        return self._mask

    def consume(self, tokens: Sequence[int]) -> int:
        """Advance past the tokens a step appended (a stop token ends the job and is not consumed),
        then start computing the next mask. Returns how many tokens the grammar took: up to the one
        that completed it, when a verified step's tokens go on past its end (a draft that ended where
        the grammar did, then the bonus token), or up to a stop token; else all."""
        stops = set(self.stop_token_ids)
        self.packed_mask()  # the mask thread must not read the matcher while it moves
        for taken, token in enumerate(tokens):
            if token in stops:
                return taken
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constraint: token {token} was sampled but the grammar refuses it: "
                                   f"{limit_problem(self.matcher.get_error())}")
            if self.matcher.is_stopped():
                self.complete = True
                return taken + 1
        self._mask = self.pool.submit(self._compute)
        return len(tokens)

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
        mask = _fill_mask(self.matcher, self.eos_token_id, self.bitmask_words)
        self.times.computed_s += time.perf_counter() - started
        self.times.masks += 1
        return mask


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
