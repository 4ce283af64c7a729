"""exllamav2's further samplers (typical, tfs, skew, quadratic smoothing, dynamic temperature,
temperature_last, mirostat v2, DRY, XTC, repetition range/decay): each against a reference
written here from its definition, one token at a time in plain Python, through the batched
sampler (BatchSampler) the generator samples plain steps and speculative verify rows with,
each checked row sitting in a batch beside rows of other settings."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import engine.sampling
import engine.slot_extras
from engine import Generator, Job
from engine.batch_sampler import BatchSampler
from engine.sampler_settings import DRY_MAX_NGRAM, SamplerSettings, SamplerSettingsError
from engine.sampling_state import SampleRow, SamplingState
from engine.sequence import Sequence
from tests.engine_runs import run
from tests.sampler_rows import CPU, probabilities, row, sample


@dataclass
class Running:
    """A running job as the generator holds it: its tokens and its sampling state."""

    sequence: Sequence
    state: SamplingState

    @property
    def row(self) -> SampleRow:
        """The row that draws (and commits) the job's next token."""
        return self.state.next_row(self.sequence)

    def append(self, token: int) -> None:
        self.sequence.append(token)


def make_job(settings: SamplerSettings, context: Seq[int] = (0,), serial: int = 0, seed: int = 0,
             generated: int = 0) -> Running:
    """A running job whose last `generated` context tokens are its output."""
    prompt, output = list(context[: len(context) - generated]), list(context[len(context) - generated:])
    job = Job(prompt, 1000, gen_settings=settings, stop_conditions=[], seed=seed)
    sequence = Sequence(job, serial, [*prompt, *output], len(prompt), 0.0, output_ids=output)
    return Running(sequence, SamplingState(seed, frozenset()))


def batch_distribution(logits: torch.Tensor, settings: Seq[SamplerSettings],
                       contexts: Seq[Seq[int]] | None = None) -> torch.Tensor:
    """The distribution each row draws from, all rows in one batch of the BatchSampler."""
    contexts = contexts or [[0]] * len(settings)
    return probabilities(logits, [row(s, seed=i, prompt=c) for i, (s, c) in
                                  enumerate(zip(settings, contexts, strict=True))])


def check(logits: Seq[float], settings: SamplerSettings, expected: Seq[float], context: Seq[int] = (0,)) -> None:
    """Row 1 of a three-row batch (plain neighbours on either side) matches expected."""
    one = torch.tensor([list(logits)])
    neighbours = SamplerSettings(temperature=0.9), SamplerSettings(top_k=3)
    batch = torch.cat([one.flip(1), one, one.roll(1, 1)])
    probs = batch_distribution(batch, [neighbours[0], settings, neighbours[1]], [[0], list(context), [0]])
    torch.testing.assert_close(probs[1], torch.tensor(list(expected), dtype=torch.float32), atol=2e-6, rtol=1e-5)


# --- reference formulas, per token ------------------------------------------------


def softmax(xs: Seq[float], temperature: float = 1.0) -> list[float]:
    peak = max(xs)
    e = [math.exp((x - peak) / temperature) if x != -math.inf else 0.0 for x in xs]
    return [v / sum(e) for v in e]


def normalized(ps: Seq[float]) -> list[float]:
    total = sum(ps)
    return [p / total for p in ps]


def keep_only(ps: Seq[float], kept: set[int]) -> list[float]:
    return normalized([p if i in kept else 0.0 for i, p in enumerate(ps)])


def by_probability(ps: Seq[float]) -> list[int]:
    return sorted(range(len(ps)), key=lambda i: (-ps[i], i))


def typical_reference(ps: Seq[float], mass: float) -> list[float]:
    entropy = -sum(p * math.log(p) for p in ps if p > 0)
    ranked = sorted((i for i, p in enumerate(ps) if p >= 1e-8), key=lambda i: (abs(-math.log(ps[i]) - entropy), i))
    kept, total = set(), 0.0
    for i in ranked:
        kept.add(i)
        total += ps[i]
        if total >= mass:
            break
    return keep_only(ps, kept)


def tail_free_reference(ps: Seq[float], z: float) -> list[float]:
    order = by_probability(ps)
    s = [ps[i] for i in order]
    second = [abs(s[i] - 2 * s[i + 1] + s[i + 2]) for i in range(len(s) - 2)]
    cut, running = len(s) - 2, 0.0
    for i, d in enumerate(second):
        running += d / sum(second)
        if running > z:
            cut = i
            break
    return keep_only(ps, set(order[: cut + 1]))


def mirostat_reference(ps: Seq[float], mu: float) -> list[float]:
    top = by_probability(ps)[0]
    return keep_only(ps, {top} | {i for i, p in enumerate(ps) if p >= 2.0 ** -mu})


def powered(ps: Seq[float], temperature: float) -> list[float]:
    return normalized([p ** (1.0 / temperature) if p > 0 else 0.0 for p in ps])


def dynamic_temperature(ps: Seq[float], low: float, high: float, exponent: float) -> float:
    left = sum(1 for p in ps if p > 0)
    entropy = -sum(p * math.log(p) for p in ps if p > 0)
    return low + (high - low) * (entropy / math.log(left)) ** exponent


def xtc_reference(ps: Seq[float], probability: float, threshold: float, ignore: Seq[int] = ()) -> list[float]:
    eligible = [i for i, p in enumerate(ps) if p >= threshold and p > 0 and i not in ignore]
    if len(eligible) < 2:
        return list(ps)
    spared = min(eligible, key=lambda i: (ps[i], -i))
    removed = set(eligible) - {spared}
    left = sum(p for i, p in enumerate(ps) if i not in removed)
    return [(1 - probability) * p + probability * (0.0 if i in removed else p / left) for i, p in enumerate(ps)]


def skew_reference(ps: Seq[float], skew: float) -> list[float]:
    out, before = [0.0] * len(ps), 0.0
    for i in by_probability(ps):
        after = before + ps[i]
        out[i] = min(after, 1.0) ** math.exp(skew) - min(before, 1.0) ** math.exp(skew)
        before = after
    return out


def dry_reference(t: Seq[int], s: SamplerSettings, vocab: int) -> dict[int, float]:
    """exllamav2's DRY by brute force: the longest suffix that is an earlier n-gram (no breaker,
    starting in the range, ending before the newest token), then a penalty per continuation."""
    n, start = len(t), max(len(t) - 1 - s.dry_range, 0) if s.dry_range else 0

    def ngram(i: int, length: int) -> bool:
        return (length <= DRY_MAX_NGRAM and i >= start and i + length - 1 <= n - 2
                and all(t[j] not in s.dry_sequence_breakers and 0 <= t[j] < vocab for j in range(i, i + length)))

    for length in range(min(DRY_MAX_NGRAM, n), s.dry_allowed_length - 1, -1):
        starts = [i for i in range(n) if ngram(i, length) and list(t[i:i + length]) == list(t[n - length:])]
        if starts:
            follows = Counter(t[i + length] for i in starts if ngram(i, length + 1))
            scale = s.dry_multiplier * s.dry_base ** (length - s.dry_allowed_length)
            return {token: scale * count for token, count in follows.items()}
    return {}


def repetition_reference(xs: Seq[float], t: Seq[int], penalty: float, sustain: int, decay: int) -> list[float]:
    """exllamav2's loop, as written: back from the newest token, a token's first (most recent)
    occurrence applies the current penalty, which fades by (1 - penalty) / decay per token once
    `sustain` tokens are behind."""
    out, seen = list(xs), set()
    left = len(t) if sustain == -1 else sustain
    current, step = penalty, (1.0 - penalty) / decay if decay else 0.0
    for i in range(len(t) - 1, max(len(t) - left - decay, 0) - 1, -1):
        token = t[i]
        if 0 <= token < len(xs) and token not in seen:
            out[token] = out[token] / current if out[token] > 0 else out[token] * current
            seen.add(token)
        left -= 1
        if left < 0:
            current += step
    return out


def random_logits(seed: int, vocab: int = 12, scale: float = 2.0) -> list[float]:
    return (torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


# --- the samplers -------------------------------------------------------------------


@pytest.mark.parametrize("mass", [0.3, 0.6, 0.9])
def test_typical_keeps_the_tokens_nearest_the_entropy(mass: float):
    for seed in range(4):
        xs = random_logits(seed)
        check(xs, SamplerSettings(typical=mass), typical_reference(softmax(xs), mass))
    # the most likely token is not necessarily typical: here it is dropped
    xs = [2.0] + [1.0] * 5 + [-2.0] * 6
    expected = typical_reference(softmax(xs), 0.5)
    assert expected[0] == 0.0
    check(xs, SamplerSettings(typical=0.5), expected)


@pytest.mark.parametrize("z", [0.3, 0.7, 0.95])
def test_tail_free_cuts_where_the_second_difference_mass_passes_tfs(z: float):
    for seed in range(4):
        xs = random_logits(seed, scale=1.5)
        expected = tail_free_reference(softmax(xs), z)
        assert 0 < sum(p > 0 for p in expected) < len(xs) or z == 0.95
        check(xs, SamplerSettings(tfs=z), expected)


def test_top_a_then_min_p_as_exllamav2_orders_them():
    xs = [2.4, 1.3, 1.0, 0.4, 0.2, 0.0]
    ps = softmax(xs)
    after_top_a = keep_only(ps, {i for i, p in enumerate(ps) if p >= 0.5 * max(ps) ** 2})
    expected = keep_only(after_top_a, {i for i, p in enumerate(after_top_a) if p >= 0.3 * max(after_top_a)})
    after_min_p = keep_only(ps, {i for i, p in enumerate(ps) if p >= 0.3 * max(ps)})
    min_p_first = keep_only(after_min_p, {i for i, p in enumerate(after_min_p) if p >= 0.5 * max(after_min_p) ** 2})
    assert expected != min_p_first  # the order matters for these numbers
    check(xs, SamplerSettings(top_a=0.5, min_p=0.3), expected)


@pytest.mark.parametrize(("factor", "temperature"), [(0.3, 1.0), (1.5, 0.7)])
def test_smoothing_factor_is_quadratic_in_the_gap_to_the_top_logit(factor: float, temperature: float):
    xs = random_logits(5)
    top = max(xs)
    expected = softmax([-factor * (x - top) ** 2 for x in xs], temperature)
    check(xs, SamplerSettings(temperature=temperature, smoothing_factor=factor), expected)


def test_dynamic_temperature_follows_the_normalized_entropy_of_what_is_left():
    xs = random_logits(6)
    low, high, exponent = 0.3, 2.0, 1.5
    ps = softmax(xs)
    left = keep_only(ps, {i for i, p in enumerate(ps) if p >= 0.05 * max(ps)})  # min_p=0.05 first
    assert 1 < sum(p > 0 for p in left) < len(xs)
    check(xs, SamplerSettings(min_p=0.05, min_temp=low, max_temp=high, temp_exponent=exponent),
          powered(left, dynamic_temperature(left, low, high, exponent)))
    truncated = keep_only(ps, set(by_probability(ps)[:5]))  # top_k=5 first
    hot = dynamic_temperature(truncated, low, high, exponent)
    settings = SamplerSettings(top_k=5, min_temp=low, max_temp=high, temp_exponent=exponent)
    check(xs, settings, powered(truncated, hot))
    # with temperature first (temperature_last off) both temperatures apply, as in exllamav2
    cooled = keep_only(softmax(xs, 0.5), set(by_probability(softmax(xs))[:5]))
    check(xs, SamplerSettings(temperature=0.5, top_k=5, min_temp=low, max_temp=high, temp_exponent=exponent),
          powered(cooled, dynamic_temperature(cooled, low, high, exponent)))
    # with temperature_last, the dynamic temperature replaces the temperature
    check(xs, SamplerSettings(temperature=0.5, temperature_last=True, top_k=5, min_temp=low, max_temp=high,
                              temp_exponent=exponent), powered(truncated, hot))


def test_temperature_last_applies_the_temperature_after_truncation():
    xs = [3.0, 2.0, 1.2, 0.5, 0.0, -0.5]
    first = softmax(xs, 2.0)
    expected_first = keep_only(first, {i for i, p in enumerate(first) if p >= 0.3 * max(first)})
    plain = softmax(xs)
    expected_last = powered(keep_only(plain, {i for i, p in enumerate(plain) if p >= 0.3 * max(plain)}), 2.0)
    assert sum(p > 0 for p in expected_first) != sum(p > 0 for p in expected_last)
    check(xs, SamplerSettings(temperature=2.0, min_p=0.3), expected_first)
    check(xs, SamplerSettings(temperature=2.0, min_p=0.3, temperature_last=True), expected_last)


def test_mirostat_keeps_tokens_below_mu_and_moves_mu_after_each_draw():
    xs = random_logits(7)
    ps = softmax(xs)
    tau, eta = 2.0, 0.5
    settings = SamplerSettings(mirostat=True, mirostat_tau=tau, mirostat_eta=eta)
    check(xs, settings, mirostat_reference(ps, 2 * tau))  # mu starts at 2 tau
    sampler = BatchSampler(2, len(xs), CPU)
    job = make_job(settings, seed=3)
    logits = torch.tensor([xs])
    mu = 2 * tau
    for _ in range(6):
        expected = mirostat_reference(ps, mu)
        torch.testing.assert_close(sampler.distribution(logits, [job.row])[0], torch.tensor(expected))
        token = int(sampler.sample(logits, [job.row])[0])
        job.append(token)
        mu += eta * (tau - -math.log2(expected[token]))
        assert float(sampler.extras.mirostat_mu[0]) == pytest.approx(mu, rel=1e-5)
    # a job that resumes with another mu (its mu history) moves it the same way
    resumed = make_job(settings, serial=1)
    resumed.state.mu_history.append(torch.tensor(3.0))
    token = int(sampler.sample(logits, [resumed.row])[0])
    moved = 3.0 + eta * (tau + math.log2(mirostat_reference(ps, 3.0)[token]))
    assert float(resumed.state.mu_history[-1]) == pytest.approx(moved)
    assert float(sampler.extras.mirostat_mu[sampler._slots[1]]) == pytest.approx(moved)


def test_mirostat_drives_the_observed_surprise_towards_tau():
    xs = random_logits(8, vocab=40, scale=1.0)
    logits = torch.tensor([xs])
    for tau in (1.0, 3.0):
        sampler = BatchSampler(1, len(xs), CPU)
        job = make_job(SamplerSettings(mirostat=True, mirostat_tau=tau, mirostat_eta=0.2), seed=1)
        surprises = []
        for _ in range(400):
            probs = sampler.distribution(logits, [job.row])[0]
            token = int(sampler.sample(logits, [job.row])[0])
            job.append(token)
            surprises.append(-math.log2(float(probs[token])))
        assert sum(surprises[100:]) / 300 == pytest.approx(tau, abs=0.35)
    entropy = -sum(p * math.log2(p) for p in softmax(xs))
    assert entropy > 4.0  # without mirostat the mean surprise would be about this


def test_mirostat_mu_survives_preemption_and_starts_fresh_for_a_new_job():
    settings = SamplerSettings(mirostat=True, mirostat_tau=1.0, mirostat_eta=0.5)
    logits = torch.tensor([random_logits(9)])
    sampler = BatchSampler(2, logits.shape[1], CPU)
    job = make_job(settings, seed=5)
    for _ in range(3):
        job.append(int(sampler.sample(logits, [job.row])[0]))
    mu = float(sampler.extras.mirostat_mu[0])
    assert mu != 2.0
    sampler.release(job.sequence.serial)  # preempted
    newcomer = make_job(settings, serial=1, seed=5)
    sampler.distribution(logits.expand(2, -1), [newcomer.row, job.row])
    slots = sampler._slots
    assert float(sampler.extras.mirostat_mu[slots[0]]) == mu
    assert float(sampler.extras.mirostat_mu[slots[1]]) == 2.0


def test_a_rewind_takes_mirostat_mu_back_to_the_token_it_rewinds_to():
    """A banned-string rewind to token 2 redraws it with the mu token 2 first saw, not with
    the mu that the tokens since taken back moved it to."""
    settings = SamplerSettings(mirostat=True, mirostat_tau=1.0, mirostat_eta=0.5)
    logits = torch.tensor([random_logits(9)])
    sampler = BatchSampler(1, logits.shape[1], CPU)
    job = make_job(settings, seed=5)
    serial = job.sequence.serial
    mu_before = [2.0]
    for _ in range(5):
        job.append(int(sampler.sample(logits, [job.row])[0]))
        mu_before.append(float(sampler.extras.mirostat_mu[sampler._slots[serial]]))
    assert len(set(mu_before)) > 2
    drawn = list(job.sequence.output_ids)
    sampler.release(serial)
    job.sequence.rewind(2)
    assert int(sampler.sample(logits, [job.row])[0]) == drawn[2]  # same uniform, same mu: the same draw
    job.append(drawn[2])
    assert float(sampler.extras.mirostat_mu[sampler._slots[serial]]) == mu_before[3]


def test_xtc_excludes_the_top_choices_but_the_least_likely_of_them_with_its_probability():
    xs = [2.0, 1.8, 1.5, 0.2, 0.0, -1.0]
    ps = softmax(xs)
    assert sum(p >= 0.15 for p in ps) == 3
    certain = xtc_reference(ps, 1.0, 0.15)
    assert certain[0] == certain[1] == 0.0 and certain[2] > ps[2]
    check(xs, SamplerSettings(xtc_probability=1.0, xtc_threshold=0.15), certain)
    check(xs, SamplerSettings(xtc_probability=0.4, xtc_threshold=0.15), xtc_reference(ps, 0.4, 0.15))
    check(xs, SamplerSettings(xtc_probability=1.0, xtc_threshold=0.3), ps)  # fewer than two above it
    spared = xtc_reference(ps, 1.0, 0.15, ignore=[0])
    assert spared[0] > 0 and spared[1] == 0.0
    check(xs, SamplerSettings(xtc_probability=1.0, xtc_threshold=0.15, xtc_ignore_tokens=(0,)), spared)
    # after top_k, on the sorted path
    top3 = keep_only(ps, {0, 1, 2})
    check(xs, SamplerSettings(top_k=3, xtc_probability=0.7, xtc_threshold=0.25), xtc_reference(top3, 0.7, 0.25))


def test_xtc_draws_are_deterministic_per_seed_and_do_not_depend_on_the_batch():
    vocab, steps = 24, 30
    logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(10))
    settings = SamplerSettings(xtc_probability=0.5, xtc_threshold=0.05, temperature=1.3)

    def run(seed: int, neighbours: int) -> list[int]:
        sampler = BatchSampler(neighbours + 1, vocab, CPU)
        probe = make_job(settings, seed=seed, serial=100)
        others = [make_job(SamplerSettings(top_p=0.8, skew=0.5), seed=j, serial=j) for j in range(neighbours)]
        drawn = []
        for step in range(steps):
            now = logits[step:step + 1]
            batch = torch.cat([now.roll(j + 1, 1) for j in range(neighbours)] + [now])
            token = int(sampler.sample(batch, [*(other.row for other in others), probe.row])[-1])
            probe.append(token)
            drawn.append(token)
        return drawn

    assert run(7, 0) == run(7, 0) == run(7, 3)
    assert run(7, 0) != run(8, 0)
    # the sampler draws from the distribution it reports: with certain exclusion, never a top choice
    certain = SamplerSettings(xtc_probability=1.0, xtc_threshold=0.2)
    xs = torch.tensor([[3.0, 2.8, 0.0, -0.5, -1.0, -1.0]])
    excluded = int(xs[0].argmax())
    draws = sample(xs.expand(64, -1), [row(certain, seed=s) for s in range(64)])
    assert excluded not in draws.tolist() and 1 in draws.tolist()


@pytest.mark.parametrize("skew", [-1.0, 0.5, 2.0])
def test_skew_reshapes_the_sorted_distribution(skew: float):
    xs = random_logits(11)
    check(xs, SamplerSettings(skew=skew), skew_reference(softmax(xs), skew))
    top = keep_only(softmax(xs), set(by_probability(softmax(xs))[:4]))
    check(xs, SamplerSettings(top_k=4, skew=skew), skew_reference(top, skew))
    # XTC reorders the probabilities; skew reads them sorted again
    mixed = xtc_reference(softmax(xs), 0.6, 0.1)
    check(xs, SamplerSettings(xtc_probability=0.6, xtc_threshold=0.1, skew=skew), skew_reference(mixed, skew))


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def reference_uniform(seed: int, draw: int) -> float:
    """The uniform of a job's token `draw`, as engine/batch_sampler.py defines it: the lowbias32
    hash chained over the draw index (offset by 0x9E3779B9), the seed's high then low 32 bits, kept
    to 24 bits and centred in their interval."""
    mixed = lowbias32((seed & 0xFFFFFFFF) ^ lowbias32((seed >> 32) ^ lowbias32((draw ^ 0x9E3779B9) & 0xFFFFFFFF)))
    return ((mixed >> 8) + 0.5) / (1 << 24)


def test_skew_draws_with_the_uniform_raised_to_exp_minus_skew():
    xs = random_logits(12)
    ps = softmax(xs)
    order = by_probability(ps)
    for seed, draw in [(seed, seed % 7) for seed in range(40)]:
        uniform = reference_uniform(seed, draw)
        point, running, expected = uniform ** math.exp(-1.5), 0.0, order[-1]
        for token in order:
            running += ps[token]
            if running > point:
                expected = token
                break
        assert int(sample(torch.tensor([xs]), [row(SamplerSettings(skew=1.5), seed=seed, draw=draw)])[0]) == expected


def dry_expected(xs: Seq[float], context: Seq[int], settings: SamplerSettings) -> list[float]:
    penalties = dry_reference(context, settings, len(xs))
    return softmax([x - penalties.get(i, 0.0) for i, x in enumerate(xs)])


def test_dry_penalises_the_continuation_of_a_repeated_sequence():
    xs = [0.5] * 10
    settings = SamplerSettings(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=2)
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3]  # "1 2 3" was followed by 4: a length-3 match
    assert dry_reference(context, settings, 10) == {4: 0.8 * 2.0 ** (3 - 2)}
    check(xs, settings, dry_expected(xs, context, settings), context)
    twice = [1, 2, 3, 4, 8, 1, 2, 3, 6, 9, 1, 2, 3]  # two earlier copies, two continuations
    assert dry_reference(twice, settings, 10) == {4: 1.6, 6: 1.6}
    check(xs, settings, dry_expected(xs, twice, settings), twice)
    # greedy rows honour DRY too, over the prompt and the generated tokens alike
    greedy = SamplerSettings(temperature=0.0, dry_multiplier=5.0, dry_allowed_length=2)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    assert int(sample(logits, [row(greedy, prompt=context)])[0]) == 5
    sampler = BatchSampler(1, 10, CPU)
    assert int(sampler.sample(logits, [make_job(greedy, context, generated=4).row])[0]) == 5


def test_dry_respects_breakers_allowed_length_and_range():
    xs = [0.5] * 10
    base = dict(dry_multiplier=1.0, dry_base=1.5)
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert dry_reference(context, SamplerSettings(**base, dry_sequence_breakers=(2,)), 10) == {}
    check(xs, SamplerSettings(**base, dry_sequence_breakers=(2,)), softmax(xs), context)
    shortened = SamplerSettings(**base, dry_sequence_breakers=(1,))  # the match is "2 3" now
    assert dry_reference(context, shortened, 10) == {4: 1.0}
    check(xs, shortened, dry_expected(xs, context, shortened), context)
    assert dry_reference(context, SamplerSettings(**base, dry_allowed_length=4), 10) == {}
    check(xs, SamplerSettings(**base, dry_allowed_length=4), softmax(xs), context)
    assert dry_reference(context, SamplerSettings(**base, dry_allowed_length=3), 10) == {4: 1.0}
    check(xs, SamplerSettings(**base, dry_allowed_length=3), softmax(xs[:4] + [xs[4] - 1.0] + xs[5:]), context)
    far = [1, 2, 3, 4, *[7, 8] * 6, 1, 2, 3]  # the earlier copy is 16 tokens back
    assert dry_reference(far, SamplerSettings(**base, dry_range=10), 10) == {}
    check(xs, SamplerSettings(**base, dry_range=10), softmax(xs), far)
    check(xs, SamplerSettings(**base, dry_range=17), dry_expected(xs, far, SamplerSettings(**base, dry_range=17)),
          far)
    assert dry_reference(far, SamplerSettings(**base, dry_range=17), 10)


def test_dry_matches_exllamav2_on_random_contexts():
    rng = random.Random(13)
    xs = random_logits(13, vocab=8)
    for _ in range(60):
        context = [rng.randrange(8) for _ in range(rng.randrange(2, 70))]
        settings = SamplerSettings(dry_multiplier=0.7, dry_base=1.3, dry_allowed_length=rng.randrange(1, 4),
                                   dry_range=rng.choice([0, 0, 25, 40]),
                                   dry_sequence_breakers=tuple(rng.sample(range(8), rng.randrange(0, 2))))
        check(xs, settings, dry_expected(xs, context, settings), context)


@pytest.mark.parametrize(("sustain", "decay"), [(-1, 0), (0, 0), (3, 0), (3, 4), (0, 5), (6, 2)])
def test_repetition_penalty_range_and_decay_are_exllamav2_s(sustain: int, decay: int):
    xs = random_logits(14, vocab=10)
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 7]
    settings = SamplerSettings(repetition_penalty=1.8, repetition_penalty_range=sustain,
                               repetition_penalty_decay=decay)
    check(xs, settings, softmax(repetition_reference(xs, context, 1.8, sustain, decay)), context)
    rows = [row(SamplerSettings(temperature=0.0, repetition_penalty=1.8, repetition_penalty_range=sustain,
                                repetition_penalty_decay=decay), prompt=context)]
    reference = repetition_reference(xs, context, 1.8, sustain, decay)
    assert int(sample(torch.tensor([xs]), rows)[0]) == max(range(10), key=lambda i: reference[i])


def test_every_sampler_at_once_gives_one_distribution():
    vocab = 32
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(15)) * 2
    context = [4, 5, 6, 7, 1, 4, 5, 6, 31, 2, 4, 5]
    everything = SamplerSettings(
        temperature=0.8, top_k=20, top_p=0.95, min_p=0.02, top_a=0.05, repetition_penalty=1.2,
        repetition_penalty_range=8, repetition_penalty_decay=4, presence_penalty=0.3, dry_multiplier=0.8,
        dry_sequence_breakers=(1,), smoothing_factor=0.2, tfs=0.95, typical=0.95, mirostat=True, mirostat_tau=4.0,
        temperature_last=True, min_temp=0.5, max_temp=1.5, xtc_probability=0.3, xtc_threshold=0.05,
        xtc_ignore_tokens=(3,), skew=0.4)
    settings = [SamplerSettings.greedy(), everything, SamplerSettings(temperature=0.7),
                SamplerSettings(temperature=0.0, dry_multiplier=1.0, repetition_penalty=1.3,
                                repetition_penalty_range=4), SamplerSettings(typical=0.8, top_p=0.9), everything]
    probs = batch_distribution(logits, settings, [context] * 6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    assert 1 < int((probs[1] > 0).sum()) < 20  # the truncations did truncate


def test_plain_batches_run_none_of_the_further_samplers(monkeypatch: pytest.MonkeyPatch):
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("ran for a batch that does not use it")

    for name in ("_later_steps", "_tail_free", "_typical", "_mirostat", "_xtc", "_skew", "_post_temperature"):
        monkeypatch.setattr(engine.sampling, name, refuse)
    monkeypatch.setattr(engine.slot_extras, "dry_inputs", refuse)
    monkeypatch.setattr(engine.slot_extras, "repetition_weights", refuse)
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(16))
    settings = [SamplerSettings.greedy(), SamplerSettings(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
                SamplerSettings(repetition_penalty=1.2, frequency_penalty=0.5), SamplerSettings(top_a=0.1)]
    sampler = BatchSampler(4, 20, CPU)
    sampler.sample(logits, [make_job(s, [1, 2, 1], serial=i, seed=i).row for i, s in enumerate(settings)])
    sampler.distribution(logits, [make_job(s, [1, 2, 1], serial=i, seed=i).row for i, s in enumerate(settings)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"typical": 0.0}, "typical must be in (0, 1] (1 = off), got 0.0"),
        ({"tfs": 1.5}, "tfs must be in (0, 1] (1 = off), got 1.5"),
        ({"skew": 11}, "skew must be in [-10, 10] (0 = off), got 11"),
        ({"smoothing_factor": -0.1}, "smoothing_factor must be in [0, 100] (0 = off), got -0.1"),
        ({"smoothing_factor": 1e30}, "smoothing_factor must be in [0, 100] (0 = off), got 1e+30"),
        ({"min_temp": -1}, "min_temp must be in [0, 100], got -1"),
        ({"max_temp": 101}, "max_temp must be in [0, 100], got 101"),
        ({"min_temp": 1.5, "max_temp": 1.0}, "max_temp must be >= min_temp (1.5)"),
        ({"temp_exponent": 0}, "temp_exponent must be in (0, 100], got 0"),
        ({"temp_exponent": 1e9}, "temp_exponent must be in (0, 100], got 1000000000.0"),
        ({"temperature_last": 1}, "temperature_last must be true or false, got 1"),
        ({"mirostat": "yes"}, "mirostat must be true or false, got 'yes'"),
        ({"mirostat_tau": -1}, "mirostat_tau must be in [0, 100], got -1"),
        ({"mirostat_tau": 1e300}, "mirostat_tau must be in [0, 100], got 1e+300"),
        ({"mirostat_eta": 2}, "mirostat_eta must be in [0, 1], got 2"),
        ({"mirostat_eta": float("inf")}, "mirostat_eta must be a finite number"),
        ({"dry_multiplier": -1}, "dry_multiplier must be in [0, 100] (0 = off), got -1"),
        ({"dry_multiplier": 1e300}, "dry_multiplier must be in [0, 100] (0 = off), got 1e+300"),
        ({"dry_base": 0.5}, "dry_base must be in [1, 8], got 0.5"),
        ({"dry_base": 1e308}, "dry_base must be in [1, 8], got 1e+308"),
        ({"dry_allowed_length": 0}, "dry_allowed_length must be in [1, 19]"),
        ({"dry_allowed_length": 20}, "dry_allowed_length must be in [1, 19]"),
        ({"dry_allowed_length": 2.5}, "dry_allowed_length must be an integer in [1, 19], got 2.5"),
        ({"dry_range": -1}, "dry_range must be in [0, 2147483647] (0 = the whole context), got -1"),
        ({"dry_sequence_breakers": (-3,)}, "dry_sequence_breakers entry must be a token id >= 0, got -3"),
        ({"xtc_probability": 1.5}, "xtc_probability must be in [0, 1] (0 = off), got 1.5"),
        ({"xtc_threshold": -0.1}, "xtc_threshold must be in [0, 1], got -0.1"),
        ({"xtc_ignore_tokens": ("a",)}, "xtc_ignore_tokens entry must be an integer token id"),
        ({"repetition_penalty_range": -2},
         "repetition_penalty_range must be in [-1, 2147483647] (-1 = the whole context), got -2"),
        ({"repetition_penalty_range": 2**40}, "repetition_penalty_range must be in [-1, 2147483647]"),
        ({"repetition_penalty_decay": -1}, "repetition_penalty_decay must be in [0, 2147483647], got -1"),
        ({"repetition_penalty": 1e-30}, "repetition_penalty must be in [0.01, 100] (1 = off), got 1e-30"),
        ({"repetition_penalty": 1e30}, "repetition_penalty must be in [0.01, 100] (1 = off), got 1e+30"),
        ({"token_bias": {3: 1e30}}, "token_bias[3] must be in [-1e+06, 1e+06], got 1e+30"),
    ],
)
def test_invalid_settings_name_the_field_and_its_limit(kwargs: dict, message: str):
    with pytest.raises(SamplerSettingsError) as info:
        SamplerSettings(**kwargs)
    assert message in str(info.value)


def test_token_ids_beyond_the_vocabulary_are_refused_by_validate():
    with pytest.raises(SamplerSettingsError, match=r"dry_sequence_breakers contains 50, outside the vocabulary"):
        SamplerSettings(dry_sequence_breakers=(50,)).validate(50)
    with pytest.raises(SamplerSettingsError, match=r"xtc_ignore_tokens contains 60, outside the vocabulary"):
        SamplerSettings(xtc_ignore_tokens=(60,)).validate(50)
    assert SamplerSettings(dry_sequence_breakers=[3, 1, 3]) == SamplerSettings(dry_sequence_breakers=(1, 3))


def test_speculating_generator_decodes_mirostat_jobs_without_drafts(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8, use_ngram_draft=True)
    prompt = [5, 6, 7, 8] * 6
    jobs = [Job(prompt, 24, stop_conditions=[], identifier="mirostat", seed=1,
                gen_settings=SamplerSettings(mirostat=True, mirostat_tau=2.0, temperature=0.8)),
            Job(prompt, 24, stop_conditions=[], identifier="greedy-dry",
                gen_settings=SamplerSettings(temperature=0.0, dry_multiplier=0.5, xtc_probability=0.5))]
    finals = run(generator, jobs)
    assert finals["mirostat"]["new_tokens"] == finals["greedy-dry"]["new_tokens"] == 24
    assert finals["mirostat"]["accepted_draft_tokens"] == finals["mirostat"]["rejected_draft_tokens"] == 0
    assert finals["greedy-dry"]["accepted_draft_tokens"] + finals["greedy-dry"]["rejected_draft_tokens"] > 0
