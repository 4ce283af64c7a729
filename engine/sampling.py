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
7. ``min_p`` keeps the tokens with probability >= min_p * the largest probability.
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
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    token_bias: Mapping[int, float] = field(default_factory=TokenBias)
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Normalize first (ints -> floats, dict -> TokenBias, list -> tuple) so that equal
        # settings compare and hash equal; vocab-independent ranges are checked here.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise SamplerSettingsError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if not isinstance(self.token_bias, TokenBias):
            object.__setattr__(self, "token_bias", TokenBias(self.token_bias))
        banned = tuple(_token_id(t, "banned_token_ids entry") for t in self.banned_token_ids)
        object.__setattr__(self, "banned_token_ids", banned)
        self._check_ranges()

    def _check_ranges(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplerSettingsError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SamplerSettingsError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplerSettingsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplerSettingsError(f"min_p must be in [0, 1], got {self.min_p}")
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
        return bool(self.token_bias) or bool(self.banned_token_ids) or self._has_penalties

    @property
    def _needs_sort(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def validate(self, vocab_size: int) -> None:
        """Check every range, and that each token id named here lies in [0, vocab_size)."""
        self._check_ranges()
        for token in self.banned_token_ids:
            if token >= vocab_size:
                raise SamplerSettingsError(
                    f"banned_token_ids contains {token}, outside the vocabulary [0, {vocab_size})")
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
class _Group:
    """Sampled rows that share one code path; probs are unnormalized, zero where filtered."""

    rows: list[int]
    probs: torch.Tensor
    order: torch.Tensor | None  # vocab id of each column of probs when it is sorted


@dataclass
class _Prepared:
    greedy_rows: list[int]
    greedy_ids: torch.Tensor | None
    groups: list[_Group]


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Pick one token per row: int64 ids of shape [B] on the logits' device."""
    _check_batch(logits, rows)
    if _plain_greedy(rows):
        return logits.argmax(dim=-1)
    prepared = _prepare(logits, rows)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    if prepared.greedy_rows:
        out[_index(prepared.greedy_rows, logits.device)] = prepared.greedy_ids
    for group in prepared.groups:
        gens = [rows[i].generator for i in group.rows]
        pos = _draw(group.probs, gens)
        ids = pos if group.order is None else group.order.gather(1, pos[:, None]).squeeze(1)
        out[_index(group.rows, logits.device)] = ids
    return out


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The fp32 [B, V] distribution ``sample`` draws each row from (greedy rows: one-hot).

    Speculative decoding needs it to accept or resample draft tokens exactly.
    """
    _check_batch(logits, rows)
    batch, vocab = logits.shape
    device = logits.device
    out = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
    if _plain_greedy(rows):
        out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    prepared = _prepare(logits, rows)
    if prepared.greedy_rows:
        out[_index(prepared.greedy_rows, device), prepared.greedy_ids] = 1.0
    for group in prepared.groups:
        probs = group.probs / group.probs.sum(dim=-1, keepdim=True)
        if group.order is not None:
            probs = torch.zeros_like(probs).scatter_(1, group.order, probs)
        out[_index(group.rows, device)] = probs
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


def _prepare(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> _Prepared:
    """Steps 1-7: everything but the draw, shared by sample() and sampling_probs()."""
    x = logits.to(torch.float32, copy=True)  # edited in place below; the caller's tensor is not
    _apply_bias_and_masks(x, rows)
    _apply_penalties(x, rows)
    _check_finite(x, logits, rows)

    greedy_rows = [i for i, r in enumerate(rows) if r.settings.is_greedy]
    greedy_ids = x[_index(greedy_rows, x.device)].argmax(dim=-1) if greedy_rows else None
    groups = []
    for needs_sort in (False, True):
        members = [i for i, r in enumerate(rows)
                   if not r.settings.is_greedy and r.settings._needs_sort == needs_sort]
        if members:
            groups.append(_filter(x, rows, members, needs_sort))
    return _Prepared(greedy_rows, greedy_ids, groups)


def _apply_bias_and_masks(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Step 1, as two indexed writes for the whole batch."""
    vocab = x.shape[1]
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, row in enumerate(rows):
        settings = row.settings
        if settings.token_bias:
            bias_rows.extend([i] * len(settings.token_bias))
            bias_ids.extend(settings.token_bias.keys())
            bias_values.extend(settings.token_bias.values())
        n_masked = len(settings.banned_token_ids) + len(row.suppress_ids)
        if n_masked:
            mask_rows.extend([i] * n_masked)
            mask_ids.extend(settings.banned_token_ids)
            mask_ids.extend(int(t) for t in row.suppress_ids)
    if (bias_ids and max(bias_ids) >= vocab) or (mask_ids and (min(mask_ids) < 0 or max(mask_ids) >= vocab)):
        _raise_out_of_vocab(rows, vocab)
    if bias_rows:
        index = (_index(bias_rows, x.device), _index(bias_ids, x.device))
        x.index_put_(index, torch.tensor(bias_values, dtype=x.dtype, device=x.device), accumulate=True)
    if mask_rows:
        x[_index(mask_rows, x.device), _index(mask_ids, x.device)] = -math.inf


def _raise_out_of_vocab(rows: Sequence[SamplingRow], vocab: int) -> None:
    for i, row in enumerate(rows):
        row.settings.validate(vocab)
        for token in row.suppress_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"suppress_ids of row {i} contains {token}, outside the vocabulary [0, {vocab})")


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Step 2, only on the rows that have penalties."""
    vocab = x.shape[1]
    rep = [i for i, r in enumerate(rows) if r.settings.repetition_penalty != 1.0]
    if rep:
        counts = _token_counts([(rows[i].prompt_ids, rows[i].output_ids) for i in rep], vocab, x.device)
        penalty = torch.tensor([rows[i].settings.repetition_penalty for i in rep], device=x.device)[:, None]
        index = _index(rep, x.device)
        sub = x[index]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        x[index] = torch.where(counts > 0, penalized, sub)
    openai = [i for i, r in enumerate(rows)
              if r.settings.frequency_penalty != 0.0 or r.settings.presence_penalty != 0.0]
    if openai:
        counts = _token_counts([(rows[i].output_ids,) for i in openai], vocab, x.device)
        freq = torch.tensor([rows[i].settings.frequency_penalty for i in openai], device=x.device)[:, None]
        presence = torch.tensor([rows[i].settings.presence_penalty for i in openai], device=x.device)[:, None]
        index = _index(openai, x.device)
        x[index] = x[index] - freq * counts - presence * (counts > 0).to(x.dtype)


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


def _check_finite(x: torch.Tensor, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Fail with a named cause instead of sampling from NaN (one reduction, one sync)."""
    bad = ~torch.isfinite(x.amax(dim=-1))
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    row, settings, vocab = rows[i], rows[i].settings, x.shape[1]
    if not bool(torch.isfinite(logits[i].float().amax())):
        raise EmptyDistributionError(
            f"row {i}: the model's logits are NaN, +inf or all -inf before any sampling setting applies")
    if bool(torch.isneginf(x[i]).all()):
        culprits = [name for name, value in (("token_bias", settings.token_bias),
                                             ("banned_token_ids", settings.banned_token_ids),
                                             ("suppress_ids", row.suppress_ids)) if len(value)]
        raise EmptyDistributionError(
            f"row {i}: {' and '.join(culprits) or 'the sampling settings'} leave no token with a finite "
            f"logit among the {vocab} in the vocabulary; nothing can be sampled")
    raise EmptyDistributionError(
        f"row {i}: token_bias or penalties (repetition_penalty={settings.repetition_penalty}, "
        f"frequency_penalty={settings.frequency_penalty}, presence_penalty={settings.presence_penalty}) "
        f"overflowed the logits to a non-finite value")


def _filter(x: torch.Tensor, rows: Sequence[SamplingRow], members: list[int], needs_sort: bool) -> _Group:
    """Steps 4-7 for sampled rows; sorted rows keep their order so the draw can map back."""
    device = x.device
    vocab = x.shape[1]
    settings = [rows[i].settings for i in members]
    for i in members:
        if rows[i].generator is None:
            raise ValueError(f"row {i} samples (temperature {rows[i].settings.temperature}) "
                             "but has no torch.Generator; only greedy rows may pass generator=None")
    temperature = torch.tensor([s.temperature for s in settings], device=device)[:, None]
    z = (x if len(members) == x.shape[0] else x[_index(members, device)]) / temperature
    order = None
    if needs_sort:
        z, order = z.sort(dim=-1, descending=True, stable=True)
        top_k = [s.top_k if 0 < s.top_k < vocab else vocab for s in settings]
        if min(top_k) < vocab:
            positions = torch.arange(vocab, device=device)
            z.masked_fill_(positions >= torch.tensor(top_k, device=device)[:, None], -math.inf)
    probs = torch.softmax(z, dim=-1)
    if needs_sort and any(s.top_p < 1.0 for s in settings):
        limit = torch.tensor([s.top_p - _TOP_P_TOLERANCE if s.top_p < 1.0 else math.inf for s in settings],
                             device=device)[:, None]
        cumulative = probs.cumsum(dim=-1)
        mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))
        drop = mass_before >= limit
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
    if any(s.min_p > 0.0 for s in settings):
        min_p = torch.tensor([s.min_p for s in settings], device=device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return _Group(members, probs, order)


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Step 8: inverse CDF, one uniform per row from that row's own generator.

    The target stays strictly below the row's total mass, so the first CDF entry above it
    always belongs to a token with positive probability.
    """
    draws = [torch.rand(1, generator=g, device=g.device) for g in generators]
    uniform = torch.cat([d.to(probs.device) for d in draws])
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, target, right=True)
    return pos.squeeze(1).clamp_(max=probs.shape[1] - 1)
