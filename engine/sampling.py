"""Per-job sampling settings applied to a whole batch of logits in one vectorized pass.

The batched sampler (engine/batch_sampler.py) gathers each row's settings and state into
BatchInputs and runs ``edited_logits`` then ``choose`` on logits of shape [B, V]; every row
follows its own ``SamplerSettings`` (engine/sampler_settings.py), with [B, V] tensor ops (as in
vLLM's sampler), never a Python loop over the vocabulary. The pipeline, in order (exllamav2's,
whose sampler this follows for every setting it shares):

1. ``token_bias`` is added to the logits; then ``banned_token_ids`` and the row's
   suppressed ids (stop tokens while ``min_new_tokens`` is not reached) are set to -inf,
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
14. One token per row is drawn by inverse CDF from the row's uniform, a hash of its job's seed
    and the index of the token drawn (engine/batch_sampler.py).

Where genq departs from exllamav2's kernels, it does so on purpose: ``typical`` uses the
paper's (and HF's) surprise -log p where exllamav2 adds p to log p, and keeps the token
that crosses the mass as top_p does; dynamic temperature normalizes the entropy by the
log of the number of tokens left with nonzero probability; XTC's least likely eligible
token is the last one in the row's sorted order (ties: the higher id).

Batch invariance: a row's draw depends only on its own logits, settings, seed and draw index.
Every step
above is applied row by row (a step some rows of a group use leaves the others' values
untouched), and whether a row's distribution is sorted depends only on its own settings,
so a seeded job produces the same tokens whatever else shares its batch.

Fast path: a batch of plain greedy rows (no bias, bans, suppression or penalties) is a
single argmax; penalty count tensors are only built for the rows that have penalties, and
each step from 8 on runs only when some row of the batch enables it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from engine.sampler_settings import (
    DRY_MAX_NGRAM,
    ROW_PARAM_COLUMN,
    EmptyDistributionError,
    SamplerSettings,
)

_TOP_P_TOLERANCE = 1e-6
_NEGLIGIBLE = 1e-8  # exllamav2's candidates: tfs, typical and mirostat ignore probabilities below this
_MIN_POST_TEMPERATURE = 1e-6  # a dynamic temperature of 0 (min_temp 0, entropy 0) reads as argmax


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
        return self.params[index, ROW_PARAM_COLUMN[name], None]


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


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


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
