"""How one job picks its next token: SamplerSettings, immutable and hashable, with every range checked.

The limits keep each step's arithmetic finite in fp32, so no job's settings can overflow a step
it shares with others; each refusal names the field and its limit (engine/sampling.py applies them).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields

MAX_TEMPERATURE = 100.0
MAX_ABS_OPENAI_PENALTY = 2.0
MAX_ABS_SKEW = 10.0
# Upper bounds that keep every step's arithmetic finite in fp32 (issue: one job's setting must never
# overflow a step shared with others). The DRY penalty is dry_multiplier * dry_base^(L - allowed)
# per occurrence with L < DRY_MAX_NGRAM: 100 * 8^18 * 2^20 occurrences stays below 1e30.
MIN_SAMPLED_TEMPERATURE = 1e-5  # logits / T must stay finite: a smaller T than this reads as 0 in fp32 arithmetic
MAX_ABS_TOKEN_BIAS = 1e6
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 100.0
MAX_DRY_MULTIPLIER = 100.0
MAX_DRY_BASE = 8.0
MAX_SMOOTHING_FACTOR = 100.0
MAX_MIROSTAT_TAU = 100.0
MAX_MIROSTAT_ETA = 1.0
MAX_TEMP_EXPONENT = 100.0
MAX_CONTEXT_RANGE = 2**31 - 1  # repetition_penalty_range / _decay and dry_range: windows, clipped to the context
DRY_MAX_NGRAM = 20  # exllamav2's dry_max_ngram: the longest repeated sequence DRY looks for

# The newer samplers' per-row numbers (steps 4 and 8-13), one column each of BatchInputs.params.
ROW_PARAMS = ("typical", "tfs", "skew", "smoothing_factor", "min_temp", "max_temp", "temp_exponent",
              "temperature_last", "mirostat", "mirostat_tau", "mirostat_eta", "xtc_probability", "xtc_threshold")
ROW_PARAM_COLUMN = {name: i for i, name in enumerate(ROW_PARAMS)}


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
            if abs(float(value)) > MAX_ABS_TOKEN_BIAS:
                raise SamplerSettingsError(
                    f"token_bias[{token}] must be in [-{MAX_ABS_TOKEN_BIAS:g}, {MAX_ABS_TOKEN_BIAS:g}], got {value!r}")
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


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplerSettingsError(f"{name} must be an integer {_INTEGER_MEANINGS[name]}, got {value!r}")
    return int(value)


def _boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SamplerSettingsError(f"{name} must be true or false, got {value!r}")
    return value


def _token_set(name: str, values: Iterable[object]) -> tuple[int, ...]:
    return tuple(sorted({_token_id(t, f"{name} entry") for t in values}))


# What an integer field must be, as its type error says (its range check may say more).
_INTEGER_MEANINGS = {
    "top_k": ">= 0 (0 = off)",
    "repetition_penalty_range": ">= -1 (-1 = the whole context)",
    "repetition_penalty_decay": ">= 0",
    "dry_allowed_length": f"in [1, {DRY_MAX_NGRAM - 1}]",
    "dry_range": ">= 0 (0 = the whole context)",
}


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
        normalizers: tuple[tuple[str, Callable[[str, object], object]], ...] = (
            ("float", _real), ("int", _integer), ("bool", _boolean))
        for kind, normalize in normalizers:  # all floats first, then ints, then bools (by annotation)
            for f in fields(self):
                if f.type == kind:
                    object.__setattr__(self, f.name, normalize(f.name, getattr(self, f.name)))
        if not isinstance(self.token_bias, TokenBias):
            object.__setattr__(self, "token_bias", TokenBias(self.token_bias))
        banned = tuple(_token_id(t, "banned_token_ids entry") for t in self.banned_token_ids)
        object.__setattr__(self, "banned_token_ids", banned)
        for name in ("allowed_token_ids", "dry_sequence_breakers", "xtc_ignore_tokens"):
            object.__setattr__(self, name, _token_set(name, getattr(self, name)))
        for name, ok, limit in self._limits():
            if not ok:
                raise SamplerSettingsError(f"{name} must be {limit}, got {getattr(self, name)}")

    def _limits(self) -> tuple[tuple[str, bool, str], ...]:
        """Every range, in the order they are checked: (field, whether its value is in range, what it must be)."""
        return (
            ("temperature", 0.0 <= self.temperature <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"),
            ("temperature", not 0.0 < self.temperature < MIN_SAMPLED_TEMPERATURE,
             f"0 (greedy) or at least {MIN_SAMPLED_TEMPERATURE:g}"),
            ("top_k", self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("top_a", 0.0 <= self.top_a <= 1.0, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "> 0 (1 = off)"),
            ("repetition_penalty", MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)"),
            ("frequency_penalty", abs(self.frequency_penalty) <= MAX_ABS_OPENAI_PENALTY,
             f"in [-{MAX_ABS_OPENAI_PENALTY:g}, {MAX_ABS_OPENAI_PENALTY:g}]"),
            ("presence_penalty", abs(self.presence_penalty) <= MAX_ABS_OPENAI_PENALTY,
             f"in [-{MAX_ABS_OPENAI_PENALTY:g}, {MAX_ABS_OPENAI_PENALTY:g}]"),
            ("repetition_penalty_range", -1 <= self.repetition_penalty_range <= MAX_CONTEXT_RANGE,
             f"in [-1, {MAX_CONTEXT_RANGE}] (-1 = the whole context)"),
            ("repetition_penalty_decay", 0 <= self.repetition_penalty_decay <= MAX_CONTEXT_RANGE,
             f"in [0, {MAX_CONTEXT_RANGE}]"),
            ("dry_multiplier", 0.0 <= self.dry_multiplier <= MAX_DRY_MULTIPLIER,
             f"in [0, {MAX_DRY_MULTIPLIER:g}] (0 = off)"),
            ("dry_base", 1.0 <= self.dry_base <= MAX_DRY_BASE, f"in [1, {MAX_DRY_BASE:g}]"),
            ("dry_allowed_length", 1 <= self.dry_allowed_length < DRY_MAX_NGRAM,
             f"in [1, {DRY_MAX_NGRAM - 1}] (DRY matches sequences of at most {DRY_MAX_NGRAM} tokens)"),
            ("dry_range", 0 <= self.dry_range <= MAX_CONTEXT_RANGE,
             f"in [0, {MAX_CONTEXT_RANGE}] (0 = the whole context)"),
            ("smoothing_factor", 0.0 <= self.smoothing_factor <= MAX_SMOOTHING_FACTOR,
             f"in [0, {MAX_SMOOTHING_FACTOR:g}] (0 = off)"),
            ("tfs", 0.0 < self.tfs <= 1.0, "in (0, 1] (1 = off)"),
            ("typical", 0.0 < self.typical <= 1.0, "in (0, 1] (1 = off)"),
            ("mirostat_tau", 0.0 <= self.mirostat_tau <= MAX_MIROSTAT_TAU, f"in [0, {MAX_MIROSTAT_TAU:g}]"),
            ("mirostat_eta", 0.0 <= self.mirostat_eta <= MAX_MIROSTAT_ETA, f"in [0, {MAX_MIROSTAT_ETA:g}]"),
            ("min_temp", 0.0 <= self.min_temp <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
            ("max_temp", 0.0 <= self.max_temp <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
            ("max_temp", self.max_temp >= self.min_temp or self.max_temp == 0.0,
             f">= min_temp ({self.min_temp}) (dynamic temperature is on when max_temp > min_temp; 0 = off)"),
            ("temp_exponent", 0.0 < self.temp_exponent <= MAX_TEMP_EXPONENT, f"in (0, {MAX_TEMP_EXPONENT:g}]"),
            ("xtc_probability", 0.0 <= self.xtc_probability <= 1.0, "in [0, 1] (0 = off)"),
            ("xtc_threshold", 0.0 <= self.xtc_threshold <= 1.0, "in [0, 1]"),
            ("skew", -MAX_ABS_SKEW <= self.skew <= MAX_ABS_SKEW, f"in [-{MAX_ABS_SKEW:g}, {MAX_ABS_SKEW:g}] (0 = off)"),
        )

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
    def _edits_logits(self) -> bool:
        """Whether steps 1-2 change anything, i.e. whether a greedy row can skip them."""
        return (bool(self.token_bias) or bool(self.banned_token_ids) or bool(self.allowed_token_ids)
                or self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self._dry)

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
        """Check that each token id named here lies in [0, vocab_size) (the ranges were checked on creation)."""
        for name in ("banned_token_ids", "allowed_token_ids", "dry_sequence_breakers", "xtc_ignore_tokens"):
            for token in getattr(self, name):
                if token >= vocab_size:
                    raise SamplerSettingsError(f"{name} contains {token}, outside the vocabulary [0, {vocab_size})")
        for token in self.token_bias:
            if token >= vocab_size:
                raise SamplerSettingsError(
                    f"token_bias key {token} is outside the vocabulary [0, {vocab_size})")
