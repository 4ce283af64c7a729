"""Per-job sampling settings applied to a whole batch of logits in one vectorized pass.

Each engine step calls ``sample(logits, rows)`` with ``logits`` of shape [B, V] and one
``SamplingRow`` per row. Every row carries its own ``SamplerSettings`` and its own seeded
``torch.Generator``; the work is done with [B, V] tensor ops (as in vLLM's sampler), never
with a Python loop over the vocabulary. The pipeline, in order:

1. ``token_bias`` is added to the logits; then ``banned_token_ids`` and the row's
   ``suppress_ids`` (stop tokens while ``min_new_tokens`` is not reached) are set to -inf,
   so a bias can never revive a banned token.
2. Penalties. ``repetition_penalty`` (HF / CTRL) over prompt + generated ids: a seen
   token's positive logit is divided by the penalty, a negative one multiplied by it.
   ``frequency_penalty`` (minus penalty * count) and ``presence_penalty`` (minus penalty
   once) follow OpenAI and count generated ids only. Ids outside [0, V), such as the
   reserved ids that bind embeddings to the input, are ignored.
3. Greedy rows (temperature 0) take the argmax here, so greedy decoding honours steps 1-2
   and ignores everything below.
4. Temperature divides the logits.
5. ``top_k`` keeps exactly the k most likely tokens (ties broken by the lower token id).
6. ``top_p`` keeps the smallest set of most likely tokens whose mass reaches top_p (always
   at least one); a cumulative mass within 1e-6 of top_p counts as reaching it, so fp32
   round-off does not let one extra token in.
7. ``min_p`` keeps the tokens with probability >= min_p * the largest probability, and
   ``top_a`` (exllamav2's) those with probability >= top_a * the largest probability squared
   (both over the distribution left by top_k / top_p, renormalized).
8. One token per row is drawn by inverse CDF from a single uniform of that row's generator.

Batch invariance: a row's draw depends only on its own logits, settings and generator.
Every sampled row consumes exactly one uniform per step, greedy rows none, and whether a
row's distribution is sorted (it is when top_k or top_p is active) depends only on its own
settings, so a seeded job produces the same tokens whatever else shares its batch.

Fast path: a batch of plain greedy rows (no bias, bans, suppression or penalties) is a
single argmax; penalty count tensors are only built for the rows that have penalties.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

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
_TOP_P_TOLERANCE = 1e-6


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

    def __post_init__(self) -> None:
        # Normalize first (ints -> floats, dict -> TokenBias, list -> tuple) so that equal
        # settings compare and hash equal; vocab-independent ranges are checked here.
        for name in ("temperature", "top_p", "min_p", "top_a", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise SamplerSettingsError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if not isinstance(self.token_bias, TokenBias):
            object.__setattr__(self, "token_bias", TokenBias(self.token_bias))
        banned = tuple(_token_id(t, "banned_token_ids entry") for t in self.banned_token_ids)
        object.__setattr__(self, "banned_token_ids", banned)
        allowed = tuple(sorted({_token_id(t, "allowed_token_ids entry") for t in self.allowed_token_ids}))
        object.__setattr__(self, "allowed_token_ids", allowed)
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

    @classmethod
    def greedy(cls) -> SamplerSettings:
        """Deterministic argmax decoding."""
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def _has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def _edits_logits(self) -> bool:
        """Whether steps 1-2 change anything, i.e. whether a greedy row can skip them."""
        return (bool(self.token_bias) or bool(self.banned_token_ids) or bool(self.allowed_token_ids)
                or self._has_penalties)

    @property
    def _needs_sort(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def validate(self, vocab_size: int) -> None:
        """Check every range, and that each token id named here lies in [0, vocab_size)."""
        self._check_ranges()
        for name in ("banned_token_ids", "allowed_token_ids"):
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


@dataclass
class BatchInputs:
    """Every per-row input of one sampling pass as batch tensors on the logits'
    device, plus the rows' settings on the host (they choose the code paths, so
    choosing never waits for the device).

    bias: additive [B, V] logit edits (token_bias, and -inf for banned ids);
    masked: (rows, ids) set to -inf after the bias (suppressed stop tokens);
    allowed: (rows, [R, V] bool) the only tokens those rows may take (constraints);
    seen: [B, V] bool, ids in prompt or output (repetition penalty);
    counts: [B, V] fp32 occurrences in the output (frequency/presence penalty).
    The penalty tensors are None when no row of the batch uses them.
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


@dataclass
class _Group:
    """Sampled rows that share one code path; probs are unnormalized, zero where filtered."""

    rows: list[int]
    probs: torch.Tensor
    order: torch.Tensor | None  # vocab id of each column of probs when it is sorted


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Pick one token per row: int64 ids of shape [B] on the logits' device."""
    _check_batch(logits, rows)
    if _plain_greedy(rows):
        return logits.argmax(dim=-1)
    inputs = inputs_from_rows(logits, rows)
    x, bad = edited_logits(logits, inputs)
    _raise_if_bad(bad, logits, x, rows)
    return choose(x, inputs, _uniforms_from_rows(rows, logits.device))


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
    if inputs.repetition_penalty is not None and inputs.seen is not None:
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
    return x, ~torch.isfinite(x.amax(dim=-1))


def choose(x: torch.Tensor, inputs: BatchInputs, uniform: torch.Tensor | None) -> torch.Tensor:
    """Steps 3-8 on edited logits: greedy rows take the argmax, sampled rows draw
    with their entry of uniform ([B] in [0, 1); unused for greedy rows)."""
    greedy = [i for i, s in enumerate(inputs.settings) if s.is_greedy]
    if len(greedy) == x.shape[0]:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if greedy:
        index = _index(greedy, x.device)
        out[index] = x[index].argmax(dim=-1)
    if uniform is None:
        raise ValueError("sampled rows need uniforms")
    for group in _filter(x, inputs):
        index = _index(group.rows, x.device)
        pos = _draw(group.probs, uniform[index])
        out[index] = pos if group.order is None else group.order.gather(1, pos[:, None]).squeeze(1)
    return out


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
    return inputs


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
    """Steps 4-7 for the sampled rows, one group per code path."""
    vocab = x.shape[1]
    paths: dict[tuple[str, int], list[int]] = {}
    for i, s in enumerate(inputs.settings):
        if not s.is_greedy:
            paths.setdefault(_path(s, vocab), []).append(i)
    groups = []
    for (path, k), members in paths.items():
        index = _index(members, x.device)
        z = (x if len(members) == x.shape[0] else x[index]) / inputs.temperature[index, None]
        order = None
        if path == "top_k":
            z, order = _top_k_stable(z, k)
        elif path == "sort":
            z, order = z.sort(dim=-1, descending=True, stable=True)
        probs = torch.softmax(z, dim=-1)
        settings = [inputs.settings[i] for i in members]
        if order is not None and any(s.top_p < 1.0 for s in settings):
            top_p = inputs.top_p[index, None]
            limit = torch.where(top_p < 1.0, top_p - _TOP_P_TOLERANCE, math.inf)
            mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
            drop = mass_before >= limit
            drop[:, 0] = False
            probs = probs.masked_fill(drop, 0.0)
        if any(s.min_p > 0.0 for s in settings):
            min_p = inputs.min_p[index, None]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        if inputs.top_a is not None and any(s.top_a > 0.0 for s in settings):
            top_a = inputs.top_a[index, None]
            peak = probs.amax(dim=-1, keepdim=True)
            # p / total < top_a * (peak / total)^2, on the mass left (top_p zeroed some, unnormalized)
            probs = probs.masked_fill(probs < top_a * peak * peak / probs.sum(dim=-1, keepdim=True), 0.0)
        groups.append(_Group(members, probs, order))
    return groups


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
        if not bool(((z >= values[:, -1:]).sum(dim=-1) > k).any()):
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
