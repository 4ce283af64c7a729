"""Per-job sampling settings applied to a whole batch of logits in one vectorized pass.

Each engine step calls ``sample(logits, rows)`` with ``logits`` of shape [B, V] and one
``SamplingRow`` per row. Every row carries its own ``SamplerSettings`` and its own seeded
``torch.Generator``; the work is done with [B, V] tensor ops (as in vLLM's sampler), never
with a Python loop over the vocabulary. The pipeline, in order (exllamav2's, whose sampler
this follows for every setting it shares):

1. ``token_bias`` is added to the logits; then ``banned_token_ids`` and the row's
   ``suppress_ids`` (stop tokens while ``min_new_tokens`` is not reached) are set to -inf,
   so a bias can never revive a banned token.
2. Penalties. ``repetition_penalty`` (HF / CTRL) over prompt + generated ids: a seen
   token's positive logit is divided by the penalty, a negative one multiplied by it. With
   ``repetition_penalty_range`` >= 0 (exllamav2's token_repetition_range) only the last
   ``range`` tokens count in full, and the ``repetition_penalty_decay`` tokens before them
   with a penalty fading linearly to none; a token takes the penalty of its most recent
   occurrence. ``frequency_penalty`` (minus penalty * count) and ``presence_penalty``
   (minus penalty once) follow OpenAI and count generated ids only, over the whole output.
   Then DRY (exllamav2's, see ``dry_penalties``): the tokens that followed earlier copies of
   the longest repeated suffix lose ``dry_multiplier * dry_base ** (length -
   dry_allowed_length)`` per copy. Ids outside [0, V), such as the reserved ids that bind
   embeddings to the input, are ignored (and break DRY's sequences).
3. Greedy rows (temperature 0) take the argmax here, so greedy decoding honours steps 1-2
   and ignores everything below.
4. Temperature divides the logits (unless ``temperature_last``); ``smoothing_factor`` > 0
   (quadratic sampling) first maps each logit to -smoothing_factor * (logit - max)^2.
5. ``top_k`` keeps exactly the k most likely tokens (ties broken by the lower token id).
6. ``top_p`` keeps the smallest set of most likely tokens whose mass reaches top_p (always
   at least one); a cumulative mass within 1e-6 of top_p counts as reaching it, so fp32
   round-off does not let one extra token in.
7. ``top_a`` (exllamav2's) keeps the tokens with probability >= top_a * the largest
   probability squared, then ``min_p`` those with probability >= min_p * the largest
   (each over the distribution the steps before leave, renormalized).
8. ``tfs`` (tail-free): over the sorted probabilities, keep the head until the normalized
   absolute second differences sum past tfs.
9. ``typical`` (locally typical): keep the tokens whose surprise is closest to the
   entropy, the smallest such set whose mass reaches typical.
10. ``mirostat`` (v2): keep the tokens with surprise below the job's mu (at least one);
    after the draw, mu moves by mirostat_eta * (mirostat_tau - the drawn token's surprise).
11. ``temperature_last`` applies the temperature here instead of at step 4, to the
    truncated probabilities (p^(1/T), renormalized). Dynamic temperature (``max_temp`` >
    ``min_temp``) also applies here, in place of temperature_last's (and on top of step 4's
    when temperature_last is off, as in exllamav2), with T = min_temp + (max_temp -
    min_temp) * (entropy / log(#tokens left))^temp_exponent.
12. XTC: with probability ``xtc_probability`` the tokens at or above ``xtc_threshold``
    except the least likely of them (and ``xtc_ignore_tokens``) are excluded. As in
    exllamav2 this is the mixture (1 - xtc_probability) * p + xtc_probability * p_excluded,
    which is exactly the distribution of that coin flip followed by a draw, needs no second
    random number, and is what speculative verification must compare against.
13. ``skew`` moves the draw along the sorted distribution: the row's uniform u becomes
    u^exp(-skew), i.e. token i's probability becomes F_i^exp(skew) - F_(i-1)^exp(skew)
    over the cumulative sorted mass F (positive skew favours less likely tokens).
14. One token per row is drawn by inverse CDF from a single uniform of that row's generator.

Where genq departs from exllamav2's kernels, it does so on purpose: ``typical`` uses the
paper's (and HF's) surprise -log p where exllamav2 adds p to log p, and keeps the token
that crosses the mass as top_p does; dynamic temperature normalizes the entropy by the
log of the number of tokens left with nonzero probability; XTC's least likely eligible
token is the last one in the row's sorted order (ties: the higher id).

Batch invariance: a row's draw depends only on its own logits, settings and generator.
Every sampled row consumes exactly one uniform per step, greedy rows none, every step
above is applied row by row (a step some rows of a group use leaves the others' values
untouched), and whether a row's distribution is sorted depends only on its own settings,
so a seeded job produces the same tokens whatever else shares its batch.

Fast path: a batch of plain greedy rows (no bias, bans, suppression or penalties) is a
single argmax; penalty count tensors are only built for the rows that have penalties, and
each step from 8 on runs only when some row of the batch enables it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import torch

__all__ = [
    "EmptyDistributionError",
    "SamplerSettings",
    "SamplerSettingsError",
    "SamplingRow",
    "TokenBias",
    "sample",
    "sampling_probs",
]

MAX_TEMPERATURE = 100.0
MAX_ABS_OPENAI_PENALTY = 2.0
MAX_ABS_SKEW = 10.0
DRY_MAX_NGRAM = 20  # exllamav2's dry_max_ngram: the longest repeated sequence DRY looks for
_TOP_P_TOLERANCE = 1e-6
_NEGLIGIBLE = 1e-8  # exllamav2's candidates: tfs, typical and mirostat ignore probabilities below this
_MIN_POST_TEMPERATURE = 1e-6  # a dynamic temperature of 0 (min_temp 0, entropy 0) reads as argmax

# The newer samplers' per-row numbers (steps 4 and 8-13), one column each of BatchInputs.params.
ROW_PARAMS = ("typical", "tfs", "skew", "smoothing_factor", "min_temp", "max_temp", "temp_exponent",
              "temperature_last", "mirostat", "mirostat_tau", "mirostat_eta", "xtc_probability", "xtc_threshold")
_COLUMN = {name: i for i, name in enumerate(ROW_PARAMS)}


class SamplerSettingsError(ValueError):
    """A sampling setting is out of range; the message names the field and its limit."""


class EmptyDistributionError(ValueError):
    """Nothing is left to sample from in some row; the message names the settings to blame."""


class TokenBias(Mapping[int, float]):
    """Immutable, hashable token id -> additive logit bias, so SamplerSettings stays hashable."""

    __slots__ = ("_map", "_hash")

    def __init__(self, items: Mapping[int, float] | Iterable[tuple[int, float]] = ()) -> None:
        pairs = items.items() if isinstance(items, Mapping) else items
        bias: dict[int, float] = {}
        for key, value in pairs:
            token = _token_id(key, "token_bias key")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise SamplerSettingsError(f"token_bias[{token}] must be a finite number, got {value!r}")
            bias[token] = float(value)
        self._map = dict(sorted(bias.items()))
        self._hash = hash(tuple(self._map.items()))

    def __getitem__(self, token: int) -> float:
        return self._map[token]

    def __iter__(self) -> Iterator[int]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"TokenBias({self._map!r})"


def _token_id(value: object, what: str) -> int:
    """A token id as a plain int >= 0 (bools and floats are rejected, not coerced)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplerSettingsError(f"{what} must be an integer token id, got {value!r}")
    if value < 0:
        raise SamplerSettingsError(f"{what} must be a token id >= 0, got {value}")
    return int(value)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SamplerSettingsError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value: object, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplerSettingsError(f"{name} must be an integer {meaning}, got {value!r}")
    return int(value)


def _token_set(name: str, values: Iterable[object]) -> tuple[int, ...]:
    return tuple(sorted({_token_id(t, f"{name} entry") for t in values}))


@dataclass(frozen=True)
class SamplerSettings:
    """How one job picks its next token; immutable and hashable so jobs can share one."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    top_a: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    token_bias: Mapping[int, float] = field(default_factory=TokenBias)
    banned_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # exllamav2's allow_tokens: only these (empty = all)
    # exllamav2's samplers beyond the common ones (steps 2 and 4-13 of the module docstring)
    repetition_penalty_range: int = -1  # -1 = the whole context; else the last N tokens
    repetition_penalty_decay: int = 0  # tokens before the range over which the penalty fades out
    dry_multiplier: float = 0.0  # 0 = DRY off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_range: int = 0  # 0 = the whole context
    dry_sequence_breakers: tuple[int, ...] = ()  # token ids no repeated sequence runs through
    smoothing_factor: float = 0.0  # 0 = off
    tfs: float = 1.0  # 1 = off
    typical: float = 1.0  # 1 = off
    mirostat: bool = False  # mirostat v2
    mirostat_tau: float = 1.5
    mirostat_eta: float = 0.1
    temperature_last: bool = False
    min_temp: float = 0.0
    max_temp: float = 0.0  # dynamic temperature is on when max_temp > min_temp
    temp_exponent: float = 1.0
    xtc_probability: float = 0.0  # 0 = XTC off
    xtc_threshold: float = 0.1
    xtc_ignore_tokens: tuple[int, ...] = ()  # token ids XTC never excludes
    skew: float = 0.0

    def __post_init__(self) -> None:
        # Normalize first (ints -> floats, dict -> TokenBias, list -> tuple) so that equal
        # settings compare and hash equal; vocab-independent ranges are checked here.
        for name in ("temperature", "top_p", "min_p", "top_a", "repetition_penalty",
                     "frequency_penalty", "presence_penalty", "dry_multiplier", "dry_base", "smoothing_factor",
                     "tfs", "typical", "mirostat_tau", "mirostat_eta", "min_temp", "max_temp", "temp_exponent",
                     "xtc_probability", "xtc_threshold", "skew"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        for name, meaning in (("top_k", ">= 0 (0 = off)"),
                              ("repetition_penalty_range", ">= -1 (-1 = the whole context)"),
                              ("repetition_penalty_decay", ">= 0"),
                              ("dry_allowed_length", f"in [1, {DRY_MAX_NGRAM - 1}]"),
                              ("dry_range", ">= 0 (0 = the whole context)")):
            object.__setattr__(self, name, _integer(name, getattr(self, name), meaning))
        for name in ("mirostat", "temperature_last"):
            if not isinstance(getattr(self, name), bool):
                raise SamplerSettingsError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.token_bias, TokenBias):
            object.__setattr__(self, "token_bias", TokenBias(self.token_bias))
        banned = tuple(_token_id(t, "banned_token_ids entry") for t in self.banned_token_ids)
        object.__setattr__(self, "banned_token_ids", banned)
        for name in ("allowed_token_ids", "dry_sequence_breakers", "xtc_ignore_tokens"):
            object.__setattr__(self, name, _token_set(name, getattr(self, name)))
        self._check_ranges()

    def _check_ranges(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplerSettingsError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SamplerSettingsError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplerSettingsError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("min_p", "top_a"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SamplerSettingsError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise SamplerSettingsError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_OPENAI_PENALTY <= value <= MAX_ABS_OPENAI_PENALTY:
                raise SamplerSettingsError(
                    f"{name} must be in [-{MAX_ABS_OPENAI_PENALTY:g}, {MAX_ABS_OPENAI_PENALTY:g}], got {value}")
        self._check_exl2_ranges()

    def _check_exl2_ranges(self) -> None:
        limits = (
            ("repetition_penalty_range", self.repetition_penalty_range >= -1, ">= -1 (-1 = the whole context)"),
            ("repetition_penalty_decay", self.repetition_penalty_decay >= 0, ">= 0"),
            ("dry_multiplier", self.dry_multiplier >= 0.0, ">= 0 (0 = off)"),
            ("dry_base", self.dry_base >= 1.0, ">= 1"),
            ("dry_allowed_length", 1 <= self.dry_allowed_length < DRY_MAX_NGRAM,
             f"in [1, {DRY_MAX_NGRAM - 1}] (DRY matches sequences of at most {DRY_MAX_NGRAM} tokens)"),
            ("dry_range", self.dry_range >= 0, ">= 0 (0 = the whole context)"),
            ("smoothing_factor", self.smoothing_factor >= 0.0, ">= 0 (0 = off)"),
            ("tfs", 0.0 < self.tfs <= 1.0, "in (0, 1] (1 = off)"),
            ("typical", 0.0 < self.typical <= 1.0, "in (0, 1] (1 = off)"),
            ("mirostat_tau", self.mirostat_tau >= 0.0, ">= 0"),
            ("mirostat_eta", self.mirostat_eta >= 0.0, ">= 0"),
            ("min_temp", 0.0 <= self.min_temp <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
            ("max_temp", 0.0 <= self.max_temp <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
            ("max_temp", self.max_temp >= self.min_temp or self.max_temp == 0.0,
             f">= min_temp ({self.min_temp}) (dynamic temperature is on when max_temp > min_temp; 0 = off)"),
            ("temp_exponent", self.temp_exponent > 0.0, "> 0"),
            ("xtc_probability", 0.0 <= self.xtc_probability <= 1.0, "in [0, 1] (0 = off)"),
            ("xtc_threshold", 0.0 <= self.xtc_threshold <= 1.0, "in [0, 1]"),
            ("skew", -MAX_ABS_SKEW <= self.skew <= MAX_ABS_SKEW, f"in [-{MAX_ABS_SKEW:g}, {MAX_ABS_SKEW:g}] (0 = off)"),
        )
        for name, ok, limit in limits:
            if not ok:
                raise SamplerSettingsError(f"{name} must be {limit}, got {getattr(self, name)}")

    @classmethod
    def greedy(cls) -> SamplerSettings:
        """Deterministic argmax decoding."""
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stateful(self) -> bool:
        """Whether a draw depends on the job's earlier draws beyond its tokens (mirostat's mu), which
        speculative verification cannot follow: the generator decodes such jobs without drafts."""
        return self.mirostat and not self.is_greedy

    @property
    def _has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def _edits_logits(self) -> bool:
        """Whether steps 1-2 change anything, i.e. whether a greedy row can skip them."""
        return (bool(self.token_bias) or bool(self.banned_token_ids) or bool(self.allowed_token_ids)
                or self._has_penalties or self._dry)

    @property
    def _needs_sort(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.tfs < 1.0 or self.mirostat or self.skew != 0.0

    @property
    def _repetition_window(self) -> bool:
        """Whether the repetition penalty weighs tokens by distance (range/decay) instead of presence."""
        return self.repetition_penalty != 1.0 and self.repetition_penalty_range >= 0

    @property
    def _dry(self) -> bool:
        return self.dry_multiplier > 0.0

    @property
    def _dynamic_temperature(self) -> bool:
        return self.max_temp > self.min_temp

    @property
    def _xtc(self) -> bool:
        return self.xtc_probability > 0.0

    @property
    def _uses_row_params(self) -> bool:
        """Whether a sampled row runs any of steps 4 (smoothing) and 8-13, which read ROW_PARAMS."""
        return (self.smoothing_factor > 0.0 or self.tfs < 1.0 or self.typical < 1.0 or self.mirostat
                or self.temperature_last or self._dynamic_temperature or self._xtc or self.skew != 0.0)

    def row_params(self) -> list[float]:
        """This job's values of ROW_PARAMS, in that order (flags as 0/1)."""
        return [float(getattr(self, name)) for name in ROW_PARAMS]

    def validate(self, vocab_size: int) -> None:
        """Check every range, and that each token id named here lies in [0, vocab_size)."""
        self._check_ranges()
        for name in ("banned_token_ids", "allowed_token_ids", "dry_sequence_breakers", "xtc_ignore_tokens"):
            for token in getattr(self, name):
                if token >= vocab_size:
                    raise SamplerSettingsError(f"{name} contains {token}, outside the vocabulary [0, {vocab_size})")
        for token in self.token_bias:
            if token >= vocab_size:
                raise SamplerSettingsError(
                    f"token_bias key {token} is outside the vocabulary [0, {vocab_size})")


@dataclass
class SamplingRow:
    """One batch row: its job's settings, the ids penalties look at, and the job's RNG."""

    settings: SamplerSettings
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None
    suppress_ids: Sequence[int] = ()
    # mirostat's state for this job (None: not started, 2 * mirostat_tau); sample() updates it
    mirostat_mu: float | None = None


@dataclass
class BatchInputs:
    """Every per-row input of one sampling pass as batch tensors on the logits'
    device, plus the rows' settings on the host (they choose the code paths, so
    choosing never waits for the device).

    bias: additive [B, V] logit edits (token_bias, and -inf for banned ids);
    masked: (rows, ids) set to -inf after the bias (suppressed stop tokens);
    allowed: (rows, [R, V] bool) the only tokens those rows may take (constraints);
    seen: [B, V] bool, ids in prompt or output (repetition penalty);
    repetition_weight: [B, V] fp32 in [0, 1], how much of the repetition penalty each id
    takes, replacing seen when some row has a repetition_penalty_range;
    counts: [B, V] fp32 occurrences in the output (frequency/presence penalty);
    dry: (rows, ids, amounts) subtracted from the logits (dry_penalties);
    params: [B, len(ROW_PARAMS)] the newer samplers' numbers;
    mirostat_mu: [B] each mirostat row's mu (other rows: unused);
    xtc_ignore: [B, V] bool, ids XTC never excludes.
    The penalty and newer-sampler tensors are None when no row of the batch uses them.
    """

    settings: Sequence[SamplerSettings]
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    top_a: torch.Tensor | None = None  # None when no row of the batch uses it
    bias: torch.Tensor | None = None
    masked: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    repetition_penalty: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    repetition_weight: torch.Tensor | None = None
    dry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    params: torch.Tensor | None = None
    mirostat_mu: torch.Tensor | None = None
    xtc_ignore: torch.Tensor | None = None

    def param(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """[R, 1]: the rows' values of one of ROW_PARAMS."""
        assert self.params is not None
        return self.params[index, _COLUMN[name], None]


@dataclass
class _Group:
    """Sampled rows that share one code path; probs are unnormalized, zero where filtered.
    drawn_from: for mirostat, the normalized probabilities a drawn token's surprise is read
    from (the final distribution before skew), None when no row of the group uses mirostat."""

    rows: list[int]
    probs: torch.Tensor
    order: torch.Tensor | None  # vocab id of each column of probs when it is sorted
    drawn_from: torch.Tensor | None = None


class Choice(NamedTuple):
    """choose()'s result: [B] token ids, and [B] mirostat mu after this draw (None without mirostat)."""

    ids: torch.Tensor
    mirostat_mu: torch.Tensor | None


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Pick one token per row: int64 ids of shape [B] on the logits' device. A mirostat
    row's mirostat_mu is updated in place (as exllamav2 updates its settings' mu)."""
    _check_batch(logits, rows)
    if _plain_greedy(rows):
        return logits.argmax(dim=-1)
    inputs = inputs_from_rows(logits, rows)
    x, bad = edited_logits(logits, inputs)
    _raise_if_bad(bad, logits, x, rows)
    ids, mu = choose(x, inputs, _uniforms_from_rows(rows, logits.device))
    if mu is not None:
        for row, value in zip(rows, mu.tolist(), strict=True):
            if row.settings.mirostat and not row.settings.is_greedy:
                row.mirostat_mu = value
    return ids


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The fp32 [B, V] distribution ``sample`` draws each row from (greedy rows: one-hot).

    Speculative decoding needs it to accept or resample draft tokens exactly.
    """
    _check_batch(logits, rows)
    if _plain_greedy(rows):
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    inputs = inputs_from_rows(logits, rows)
    x, bad = edited_logits(logits, inputs)
    _raise_if_bad(bad, logits, x, rows)
    return distribution(x, inputs)


def edited_logits(logits: torch.Tensor, inputs: BatchInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 on an fp32 copy; also [B] bool: rows left with no finite logit
    (returned, not checked, so the caller decides when to wait for it)."""
    x = logits.to(torch.float32, copy=True)
    if inputs.bias is not None:
        x += inputs.bias
    if inputs.masked is not None:
        x[inputs.masked] = -math.inf
    if inputs.allowed is not None:
        rows, allowed = inputs.allowed
        if rows.shape[0] == x.shape[0]:  # every row constrained: in place, no gather/scatter of rows
            x.masked_fill_(~allowed, -math.inf)
        else:
            x[rows] = x[rows].masked_fill(~allowed, -math.inf)
    if inputs.repetition_penalty is not None and inputs.repetition_weight is not None:
        x = _weighted_repetition(x, inputs.repetition_penalty, inputs.repetition_weight)
    elif inputs.repetition_penalty is not None and inputs.seen is not None:
        if x.is_cuda:
            penalty = inputs.repetition_penalty[:, None]
            x = torch.where(inputs.seen, torch.where(x > 0, x / penalty, x * penalty), x)
        else:  # a row has seen few ids: touch only those (off CUDA, reading the indices back is free)
            rows, ids = inputs.seen.nonzero(as_tuple=True)
            values = x[rows, ids]
            penalty = inputs.repetition_penalty[rows]
            x[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)
    if inputs.counts is not None and inputs.frequency_penalty is not None and inputs.presence_penalty is not None:
        counts = inputs.counts
        x -= inputs.frequency_penalty[:, None] * counts + inputs.presence_penalty[:, None] * (counts > 0).to(x.dtype)
    if inputs.dry is not None:
        x.index_put_(inputs.dry[:2], -inputs.dry[2], accumulate=True)
    return x, ~torch.isfinite(x.amax(dim=-1))


def _weighted_repetition(x: torch.Tensor, penalty: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The repetition penalty where each id takes a fraction of it (weight 1: all of it,
    exactly the penalty; 0: none), as exllamav2 fades it over repetition_penalty_decay."""
    full = penalty[:, None].expand_as(weight)
    factor = torch.where(weight >= 1.0, full, 1.0 + (full - 1.0) * weight)
    return torch.where(weight > 0, torch.where(x > 0, x / factor, x * factor), x)


def choose(x: torch.Tensor, inputs: BatchInputs, uniform: torch.Tensor | None) -> Choice:
    """Steps 3-14 on edited logits: greedy rows take the argmax, sampled rows draw
    with their entry of uniform ([B] in [0, 1); unused for greedy rows)."""
    greedy = [i for i, s in enumerate(inputs.settings) if s.is_greedy]
    if len(greedy) == x.shape[0]:
        return Choice(x.argmax(dim=-1), inputs.mirostat_mu)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if greedy:
        index = _index(greedy, x.device)
        out[index] = x[index].argmax(dim=-1)
    if uniform is None:
        raise ValueError("sampled rows need uniforms")
    mu = inputs.mirostat_mu.clone() if inputs.mirostat_mu is not None else None
    for group in _filter(x, inputs):
        index = _index(group.rows, x.device)
        pos = _draw(group.probs, uniform[index])
        out[index] = pos if group.order is None else group.order.gather(1, pos[:, None]).squeeze(1)
        if group.drawn_from is not None and mu is not None:
            on = inputs.param("mirostat", index).squeeze(1) > 0
            tau, eta = inputs.param("mirostat_tau", index).squeeze(1), inputs.param("mirostat_eta", index).squeeze(1)
            surprise = -torch.log2(group.drawn_from.gather(1, pos[:, None]).squeeze(1))
            mu[index] = torch.where(on, mu[index] + eta * (tau - surprise), mu[index])
    return Choice(out, mu)


def distribution(x: torch.Tensor, inputs: BatchInputs) -> torch.Tensor:
    """The normalized [B, V] distribution choose() draws from (greedy rows: one-hot)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    greedy = [i for i, s in enumerate(inputs.settings) if s.is_greedy]
    if greedy:
        index = _index(greedy, x.device)
        out[index, x[index].argmax(dim=-1)] = 1.0
    for group in _filter(x, inputs):
        probs = group.probs / group.probs.sum(dim=-1, keepdim=True)
        if group.order is not None:
            probs = torch.zeros(probs.shape[0], x.shape[1], dtype=probs.dtype, device=x.device).scatter_(
                1, group.order, probs)
        out[_index(group.rows, x.device)] = probs
    return out


def _check_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(rows):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} SamplingRows were given")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")


def _plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    return all(r.settings.is_greedy and not r.settings._edits_logits and not len(r.suppress_ids)
               for r in rows)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def inputs_from_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> BatchInputs:
    """BatchInputs built from per-row Python settings and id lists (the functional API)."""
    device = logits.device
    batch, vocab = logits.shape
    settings = [r.settings for r in rows]
    for i, r in enumerate(rows):
        if not r.settings.is_greedy and r.generator is None:
            raise ValueError(f"row {i} samples (temperature {r.settings.temperature}) "
                             "but has no torch.Generator; only greedy rows may pass generator=None")
    inputs = BatchInputs(
        settings=settings,
        temperature=torch.tensor([s.temperature for s in settings], device=device),
        top_p=torch.tensor([s.top_p for s in settings], device=device),
        min_p=torch.tensor([s.min_p for s in settings], device=device),
        top_a=torch.tensor([s.top_a for s in settings], device=device),
    )
    bias_rows, bias_ids, bias_values, mask_rows, mask_ids = [], [], [], [], []
    for i, (row, s) in enumerate(zip(rows, settings)):
        bias_rows += [i] * len(s.token_bias)
        bias_ids += list(s.token_bias.keys())
        bias_values += list(s.token_bias.values())
        masked = [*s.banned_token_ids, *(int(t) for t in row.suppress_ids)]
        mask_rows += [i] * len(masked)
        mask_ids += masked
    if (bias_ids and max(bias_ids) >= vocab) or (mask_ids and (min(mask_ids) < 0 or max(mask_ids) >= vocab)):
        _raise_out_of_vocab(rows, vocab)
    if bias_rows:
        inputs.bias = torch.zeros(batch, vocab, device=device).index_put_(
            (_index(bias_rows, device), _index(bias_ids, device)),
            torch.tensor(bias_values, device=device), accumulate=True)
    restricted = [i for i, s in enumerate(settings) if s.allowed_token_ids]
    if restricted:
        inputs.bias = torch.zeros(batch, vocab, device=device) if inputs.bias is None else inputs.bias
        for i in restricted:
            inputs.bias[i] += allowed_only(settings[i].allowed_token_ids, vocab, device)
    if mask_rows:
        inputs.masked = (_index(mask_rows, device), _index(mask_ids, device))
    if any(s.repetition_penalty != 1.0 for s in settings):
        inputs.repetition_penalty = torch.tensor([s.repetition_penalty for s in settings], device=device)
        inputs.seen = _token_counts([(r.prompt_ids, r.output_ids) for r in rows], vocab, device) > 0
    if any(s.frequency_penalty != 0.0 or s.presence_penalty != 0.0 for s in settings):
        inputs.frequency_penalty = torch.tensor([s.frequency_penalty for s in settings], device=device)
        inputs.presence_penalty = torch.tensor([s.presence_penalty for s in settings], device=device)
        inputs.counts = _token_counts([(r.output_ids,) for r in rows], vocab, device)
    windowed = {i: _history(r) for i, r in enumerate(rows) if r.settings._repetition_window}
    if windowed:
        assert inputs.seen is not None
        inputs.repetition_weight = inputs.seen.to(torch.float32)
        inputs.repetition_weight[_index(list(windowed), device)] = repetition_weights(
            [(windowed[i], settings[i]) for i in windowed], vocab, device)
        inputs.seen = None
    drying = [(i, _history(r), r.settings) for i, r in enumerate(rows) if r.settings._dry]
    if drying:
        inputs.dry = dry_inputs(drying, vocab, device)
    if any(s._uses_row_params for s in settings):
        inputs.params = torch.tensor([s.row_params() for s in settings], device=device)
    if any(s.mirostat for s in settings):
        inputs.mirostat_mu = torch.tensor(
            [2.0 * s.mirostat_tau if r.mirostat_mu is None else r.mirostat_mu for r, s in zip(rows, settings)],
            device=device)
    if any(s._xtc and s.xtc_ignore_tokens for s in settings):
        inputs.xtc_ignore = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        for i, s in enumerate(settings):
            if s._xtc and s.xtc_ignore_tokens:
                s.validate(vocab)
                inputs.xtc_ignore[i, list(s.xtc_ignore_tokens)] = True
    return inputs


def _history(row: SamplingRow) -> list[int]:
    """The row's context, prompt then generated ids, as the penalties with a range read it."""
    return [*row.prompt_ids, *row.output_ids]


def repetition_weights(rows: Sequence[tuple[Sequence[int], SamplerSettings]], vocab: int,
                       device: torch.device) -> torch.Tensor:
    """[R, vocab] fp32: the fraction of the repetition penalty each id takes (exllamav2's range and
    decay). Counting back from the newest token (distance 0), the last ``range`` tokens weigh 1, the
    ``decay`` before them (distance d) weigh (range + decay - d) / decay, older ones 0; an id takes the
    weight of its most recent occurrence. Only the last range + decay ids are read."""
    out = torch.zeros(len(rows), vocab, dtype=torch.float32)
    for r, (history, settings) in enumerate(rows):
        sustain, decay = settings.repetition_penalty_range, settings.repetition_penalty_decay
        span = sustain + decay
        window = torch.tensor(list(history[-span:]) if span else [], dtype=torch.long)
        distance = torch.arange(window.shape[0] - 1, -1, -1)
        weight = torch.where(distance < sustain, 1.0, (span - distance) / max(decay, 1)).to(torch.float32)
        inside = (window >= 0) & (window < vocab)
        out[r].scatter_reduce_(0, window[inside], weight[inside], "amax")
    return out.to(device)


@lru_cache(maxsize=64)
def _breakers(ids: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def dry_penalties(history: Sequence[int], settings: SamplerSettings, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DRY as exllamav2 computes it: (token ids [N], amounts [N]) to subtract from their logits.

    exllamav2 keeps a trie of the context's n-grams (at most DRY_MAX_NGRAM tokens, none running
    through a sequence breaker or an id outside the vocabulary, starting in the last dry_range
    positions before the newest token, 0 = anywhere, and ending before it), finds the longest
    suffix of the context that is such an n-gram, and, if it is at least dry_allowed_length
    long (L), penalises each token c that followed it by dry_multiplier * dry_base^(L -
    dry_allowed_length) times the number of times suffix + c occurs. Here the same quantities
    come from match lengths: m[p], how far back the context ending at p agrees with the
    context's suffix, computed for every p at once, one vectorized comparison per suffix
    position (at most DRY_MAX_NGRAM), over the last dry_range tokens only."""
    n = len(history)
    start = max(n - 1 - settings.dry_range, 0) if settings.dry_range else 0
    tokens = torch.tensor(list(history[start:]), dtype=torch.long)
    positions = tokens.shape[0] - 1  # earlier n-grams end before the newest token
    empty = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32)
    if positions < 1:
        return empty
    breaks = (tokens < 0) | (tokens >= vocab)
    if settings.dry_sequence_breakers:
        breaks |= torch.isin(tokens, _breakers(settings.dry_sequence_breakers))
    suffix = torch.tensor(list(history[-DRY_MAX_NGRAM:])[::-1], dtype=torch.long)  # newest first
    ends = torch.arange(positions)
    length = torch.zeros(positions, dtype=torch.long)
    running = torch.ones(positions, dtype=torch.bool)
    for back in range(suffix.shape[0]):
        at = ends - back
        inside = at >= 0
        at = at.clamp(min=0)
        running &= inside & (tokens[at] == suffix[back]) & ~breaks[at]
        if not bool(running.any()):
            break
        length += running
    longest = int(length.max())
    if longest < settings.dry_allowed_length or longest >= DRY_MAX_NGRAM:
        return empty  # too short to penalise, or no room in an n-gram for a next token
    follows = (length[:-1] >= longest) & ~breaks[1:positions]
    ids, counts = torch.unique(tokens[1:positions][follows], return_counts=True)
    scale = settings.dry_multiplier * settings.dry_base ** (longest - settings.dry_allowed_length)
    return ids, counts.to(torch.float32) * scale


def dry_inputs(rows: Sequence[tuple[int, Sequence[int], SamplerSettings]], vocab: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """BatchInputs.dry for the DRY rows (batch row, context, settings); None when nothing is penalised."""
    parts = [(row, *dry_penalties(history, settings, vocab)) for row, history, settings in rows]
    parts = [(row, ids, amounts) for row, ids, amounts in parts if ids.numel()]
    if not parts:
        return None
    rows_index = torch.cat([torch.full_like(ids, row) for row, ids, _ in parts])
    return (rows_index.to(device), torch.cat([ids for _, ids, _ in parts]).to(device),
            torch.cat([amounts for _, _, amounts in parts]).to(device))


def _uniforms_from_rows(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """One uniform per sampled row from its own generator, in the order the rows'
    groups are drawn (rows sharing a generator see the same sequence as before)."""
    uniform = torch.zeros(len(rows), dtype=torch.float32)
    order = sorted((i for i, r in enumerate(rows) if not r.settings.is_greedy),
                   key=lambda i: rows[i].settings._needs_sort)
    for i in order:
        generator = rows[i].generator
        assert generator is not None
        uniform[i] = torch.rand(1, generator=generator, device=generator.device).item()
    return uniform.to(device)


def allowed_only(allowed: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] additive bias: 0 for the allowed ids, -inf for every other."""
    bias = torch.full((vocab,), -math.inf, device=device)
    bias[list(allowed)] = 0.0
    return bias


def _raise_out_of_vocab(rows: Sequence[SamplingRow], vocab: int) -> None:
    for i, row in enumerate(rows):
        row.settings.validate(vocab)
        for token in row.suppress_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"suppress_ids of row {i} contains {token}, outside the vocabulary [0, {vocab})")


def _token_counts(seqs: list[tuple[Sequence[int], ...]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab] fp32 occurrence counts via one scatter_add over a padded [n, L] id tensor.

    Padding and ids outside [0, vocab) go to a spare column ``vocab`` that is sliced off.
    """
    flat = [torch.cat([torch.as_tensor(part, dtype=torch.long).reshape(-1) for part in seq]) for seq in seqs]
    ids = torch.nn.utils.rnn.pad_sequence(flat, batch_first=True, padding_value=vocab).to(device)
    ids = torch.where((ids < 0) | (ids >= vocab), vocab, ids)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _raise_if_bad(bad: torch.Tensor, logits: torch.Tensor, x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Fail with a named cause instead of sampling from NaN (one reduction, one sync)."""
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise_empty_distribution(i, logits, x, rows[i].settings, rows[i].suppress_ids)


def raise_empty_distribution(
    i: int, logits: torch.Tensor, x: torch.Tensor, settings: SamplerSettings, suppress_ids: Sequence[int]
) -> None:
    """Raise the EmptyDistributionError that names why row i has no finite logit."""
    vocab = x.shape[1]
    if not bool(torch.isfinite(logits[i].float().amax())):
        raise EmptyDistributionError(
            f"row {i}: the model's logits are NaN, +inf or all -inf before any sampling setting applies")
    if bool(torch.isneginf(x[i]).all()):
        culprits = [name for name, value in (("token_bias", settings.token_bias),
                                             ("banned_token_ids", settings.banned_token_ids),
                                             ("allowed_token_ids", settings.allowed_token_ids),
                                             ("suppress_ids", suppress_ids)) if len(value)]
        raise EmptyDistributionError(
            f"row {i}: {' and '.join(culprits) or 'the sampling settings'} leave no token with a finite "
            f"logit among the {vocab} in the vocabulary; nothing can be sampled")
    raise EmptyDistributionError(
        f"row {i}: token_bias or penalties (repetition_penalty={settings.repetition_penalty}, "
        f"frequency_penalty={settings.frequency_penalty}, presence_penalty={settings.presence_penalty}) "
        f"overflowed the logits to a non-finite value")


def _path(settings: SamplerSettings, vocab: int) -> tuple[str, int]:
    """Which filter a sampled row takes; it depends on the row's own settings only,
    so a seeded row draws the same tokens whatever shares its batch."""
    if not settings._needs_sort:
        return "plain", 0
    if 0 < settings.top_k < vocab:
        return "top_k", settings.top_k
    return "sort", 0


def _filter(x: torch.Tensor, inputs: BatchInputs) -> list[_Group]:
    """Steps 4-13 for the sampled rows, one group per code path."""
    vocab = x.shape[1]
    paths: dict[tuple[str, int], list[int]] = {}
    for i, s in enumerate(inputs.settings):
        if not s.is_greedy:
            paths.setdefault(_path(s, vocab), []).append(i)
    groups = []
    for (path, k), members in paths.items():
        index = _index(members, x.device)
        settings = [inputs.settings[i] for i in members]
        z = _tempered(x if len(members) == x.shape[0] else x[index], inputs, index, settings)
        order = None
        if path == "top_k":
            z, order = _top_k_stable(z, k)
        elif path == "sort":
            z, order = z.sort(dim=-1, descending=True, stable=True)
        probs = torch.softmax(z, dim=-1)
        if order is not None and any(s.top_p < 1.0 for s in settings):
            top_p = inputs.top_p[index, None]
            limit = torch.where(top_p < 1.0, top_p - _TOP_P_TOLERANCE, math.inf)
            mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
            drop = mass_before >= limit
            drop[:, 0] = False
            probs = probs.masked_fill(drop, 0.0)
        if inputs.top_a is not None and any(s.top_a > 0.0 for s in settings):
            top_a = inputs.top_a[index, None]
            peak = probs.amax(dim=-1, keepdim=True)
            # p / total < top_a * (peak / total)^2, on the mass left (top_p zeroed some, unnormalized)
            probs = probs.masked_fill(probs < top_a * peak * peak / probs.sum(dim=-1, keepdim=True), 0.0)
        if any(s.min_p > 0.0 for s in settings):
            min_p = inputs.min_p[index, None]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        group = _Group(members, probs, order)
        if any(s._uses_row_params for s in settings):
            _later_steps(group, inputs, index, settings)
        groups.append(group)
    return groups


def _tempered(x: torch.Tensor, inputs: BatchInputs, index: torch.Tensor,
              settings: list[SamplerSettings]) -> torch.Tensor:
    """Step 4: logits / temperature (1 for temperature_last rows), after quadratic smoothing
    (-smoothing_factor * (logit - max)^2) for the rows that ask for it."""
    temperature = inputs.temperature[index, None]
    if any(s.temperature_last for s in settings):
        temperature = torch.where(inputs.param("temperature_last", index) > 0, 1.0, temperature)
    if any(s.smoothing_factor > 0.0 for s in settings):
        factor = inputs.param("smoothing_factor", index)
        gap = x - x.amax(dim=-1, keepdim=True)
        x = torch.where(factor > 0, -factor * gap * gap, x)
    return x / temperature


def _later_steps(group: _Group, inputs: BatchInputs, index: torch.Tensor, settings: list[SamplerSettings]) -> None:
    """Steps 8-13 on a group, each only for the rows that enable it (the others' values are kept
    as they are, unnormalized included, so their draws do not depend on their neighbours)."""
    on = torch.tensor([s._uses_row_params for s in settings], device=group.probs.device)[:, None]
    probs = torch.where(on, group.probs / group.probs.sum(dim=-1, keepdim=True), group.probs)
    if any(s.tfs < 1.0 for s in settings):
        probs = _tail_free(probs, inputs.param("tfs", index))
    if any(s.typical < 1.0 for s in settings):
        probs = _typical(probs, inputs.param("typical", index))
    if any(s.mirostat for s in settings):
        assert inputs.mirostat_mu is not None
        probs = _mirostat(probs, inputs.param("mirostat", index) > 0, inputs.mirostat_mu[index, None])
    if any(s.temperature_last or s._dynamic_temperature for s in settings):
        probs = _post_temperature(probs, inputs, index, any(s._dynamic_temperature for s in settings))
    if any(s._xtc for s in settings):
        ignore = None
        if inputs.xtc_ignore is not None:
            ignore = inputs.xtc_ignore[index]
            ignore = ignore if group.order is None else ignore.gather(1, group.order)
        probs = _xtc(probs, inputs.param("xtc_probability", index), inputs.param("xtc_threshold", index), ignore)
    if any(s._xtc and s.skew != 0.0 for s in settings):
        # XTC reorders the probabilities; skew reads them sorted again (those rows only)
        resort = (inputs.param("xtc_probability", index) > 0) & (inputs.param("skew", index) != 0)
        ranked = probs.sort(dim=-1, descending=True, stable=True).indices
        perm = torch.where(resort, ranked, torch.arange(probs.shape[1], device=probs.device))
        probs = probs.gather(1, perm)
        assert group.order is not None
        group.order = group.order.gather(1, perm)
    if any(s.mirostat for s in settings):
        group.drawn_from = probs / probs.sum(dim=-1, keepdim=True)
    if any(s.skew != 0.0 for s in settings):
        probs = _skew(probs, inputs.param("skew", index))
    group.probs = probs


def _tail_free(probs: torch.Tensor, tfs: torch.Tensor) -> torch.Tensor:
    """Step 8 on sorted, normalized rows (tfs [R, 1]; 1 = off): keep the first k + 1 tokens, k the
    first index where the normalized |second difference| of the probabilities sums past tfs
    (over the tokens of probability >= 1e-8; rows with fewer than 3 tokens left are kept whole)."""
    columns = probs.shape[1]
    if columns < 3:
        return probs
    counted = (probs >= _NEGLIGIBLE).sum(dim=-1, keepdim=True)
    second = (probs[:, :-2] - 2 * probs[:, 1:-1] + probs[:, 2:]).abs()
    second = second * (torch.arange(columns - 2, device=probs.device) < counted - 2)
    total = second.sum(dim=-1, keepdim=True)
    mass = torch.where(total > 0, second.cumsum(dim=-1) / total, 0.0)
    below = ((mass <= tfs) & (torch.arange(columns - 2, device=probs.device) < counted - 2)).sum(-1, keepdim=True)
    keep = torch.arange(columns, device=probs.device) <= below
    keep |= ((probs > 0).sum(dim=-1, keepdim=True) < 3) | (tfs >= 1.0)
    return probs * keep


def _typical(probs: torch.Tensor, typical: torch.Tensor) -> torch.Tensor:
    """Step 9 on normalized rows (typical [R, 1]; 1 = off): rank tokens by |surprise - entropy|,
    keep the smallest prefix of that ranking whose mass reaches typical (at least one token)."""
    candidate = probs >= _NEGLIGIBLE
    log_p = torch.where(candidate, probs.clamp(min=_NEGLIGIBLE).log(), 0.0)
    entropy = -(probs * log_p).sum(dim=-1, keepdim=True)
    deviation = torch.where(candidate, (-log_p - entropy).abs(), math.inf)
    rank = deviation.sort(dim=-1, stable=True).indices
    ranked = probs.gather(1, rank)
    mass_before = torch.nn.functional.pad(ranked.cumsum(dim=-1)[:, :-1], (1, 0))
    drop_ranked = (mass_before >= typical - _TOP_P_TOLERANCE) | ~candidate.gather(1, rank)
    drop_ranked[:, 0] = False
    drop = torch.zeros_like(drop_ranked).scatter_(1, rank, drop_ranked)
    return probs.masked_fill(drop & (typical < 1.0), 0.0)


def _mirostat(probs: torch.Tensor, on: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Step 10 on normalized rows: keep the most likely token and every token with surprise
    -log2 p <= mu (probability >= 2^-mu, and >= 1e-8)."""
    keep = (probs >= torch.exp2(-mu)) & (probs >= _NEGLIGIBLE)
    keep.scatter_(1, probs.argmax(dim=-1, keepdim=True), True)
    return probs.masked_fill(on & ~keep, 0.0)


def _post_temperature(probs: torch.Tensor, inputs: BatchInputs, index: torch.Tensor, any_dynamic: bool
                      ) -> torch.Tensor:
    """Step 11 on normalized rows: p^(1/T) renormalized, T the temperature (temperature_last rows)
    or the dynamic temperature; rows with a single token left are unchanged."""
    last = inputs.param("temperature_last", index) > 0
    low, high = inputs.param("min_temp", index), inputs.param("max_temp", index)
    dynamic = high > low
    temperature = torch.where(last, inputs.temperature[index, None], 1.0)
    left = (probs > 0).sum(dim=-1, keepdim=True)
    if any_dynamic:
        log_p = torch.where(probs > 0, probs.clamp(min=1e-38).log(), 0.0)
        entropy = -(probs * log_p).sum(dim=-1, keepdim=True)
        most = torch.where(left > 1, left.to(probs.dtype).log(), 1.0)
        normalized = (entropy / most).clamp(0.0, 1.0)
        adapted = low + (high - low) * normalized.pow(inputs.param("temp_exponent", index))
        temperature = torch.where(dynamic, adapted, temperature)
    scaled = torch.softmax(probs.log() / temperature.clamp(min=_MIN_POST_TEMPERATURE), dim=-1)
    return torch.where((last | dynamic) & (left > 1), scaled, probs)


def _xtc(probs: torch.Tensor, probability: torch.Tensor, threshold: torch.Tensor,
         ignore: torch.Tensor | None) -> torch.Tensor:
    """Step 12 on normalized rows: the mixture (1 - probability) * p + probability * p', p' the
    distribution without the tokens at or above threshold except the least likely of them (the
    last in column order among equals); a row with fewer than two such tokens is unchanged."""
    eligible = (probs >= threshold) & (probs > 0) & (probability > 0)
    if ignore is not None:
        eligible &= ~ignore
    least = torch.where(eligible, probs, math.inf).amin(dim=-1, keepdim=True)
    columns = torch.arange(1, probs.shape[1] + 1, device=probs.device)
    spared = ((eligible & (probs == least)) * columns).argmax(dim=-1, keepdim=True)
    excluded = eligible.scatter(1, spared, False) & (eligible.sum(dim=-1, keepdim=True) >= 2)
    kept = probs.masked_fill(excluded, 0.0)
    mixture = (1.0 - probability) * probs + probability * kept / kept.sum(dim=-1, keepdim=True)
    return torch.where(probability > 0, mixture, probs)


def _skew(probs: torch.Tensor, skew: torch.Tensor) -> torch.Tensor:
    """Step 13 on rows sorted by probability: token i gets F_i^exp(skew) - F_(i-1)^exp(skew), F the
    cumulative normalized mass, which is drawing with the uniform raised to exp(-skew)."""
    cdf = probs.cumsum(dim=-1)
    cdf = (cdf / cdf[:, -1:]).clamp(0.0, 1.0).pow(skew.exp())
    skewed = torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[:, :1])).clamp(min=0.0)
    return torch.where(skew != 0, skewed, probs)


def _top_k_stable(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row in the order a stable descending sort
    gives (ties: lower id first), without sorting the whole vocabulary.

    Off CUDA, a float top-k whose candidates are re-sorted stably is exact
    unless a tie straddles the k-th place, which one host check rules out
    (reading back is free there). Otherwise, and on CUDA where that read would
    stall the stream, each value becomes a unique int64 key (its float bits,
    ordered, then the id reversed), so top-k over the keys is exact and tie-free.
    """
    z = z + 0.0  # -0.0 -> +0.0: they compare equal, so they must rank equal
    if not z.is_cuda:
        values, order = z.topk(k, dim=-1)
        if not bool(((z >= values[:, -1:]).sum(dim=-1, dtype=torch.int32) > k).any()):  # int32: a cheaper sum
            order = order.sort(dim=-1).values
            values = z.gather(1, order)
            values, position = values.sort(dim=-1, descending=True, stable=True)
            return values, order.gather(1, position)
    vocab = z.shape[1]
    bits = z.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ids = torch.arange(vocab - 1, -1, -1, device=z.device)
    order = (ordered * (1 << 32) + ids).topk(k, dim=-1).indices
    return z.gather(1, order), order


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Step 8: inverse CDF, one uniform per row.

    The target stays strictly below the row's total mass, so the first CDF entry above it
    always belongs to a token with positive probability.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, target, right=True)
    return pos.squeeze(1).clamp_(max=probs.shape[1] - 1)
