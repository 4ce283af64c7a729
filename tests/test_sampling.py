"""Batched sampler: each test names the behaviour it pins and would fail on the obvious wrong version."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine import Generator, Job, JobRejected
from engine.batch_sampler import BatchSampler
from engine.sampler_settings import EmptyDistributionError, SamplerSettings, SamplerSettingsError
from tests.sampler_rows import CPU, probabilities, row, sample, sample_rows


def gen(seed: int) -> torch.Generator:
    """Test data (logits) only: the sampler's randomness is its rows' seeds and draw indices."""
    return torch.Generator().manual_seed(seed)


def support_over_seeds(logits_row: torch.Tensor, settings: SamplerSettings, n: int = 400) -> set[int]:
    """Tokens drawn from one row over n seeds, all in one batched call."""
    logits = logits_row.expand(n, -1).contiguous()
    return set(sample(logits, [row(settings, seed=s) for s in range(n)]).tolist())


def support_of_probs(probs_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs_row > 0).flatten().tolist())


NUCLEUS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_is_argmax_on_fast_and_general_paths():
    logits = torch.randn(5, 40, generator=gen(1))
    greedy = SamplerSettings.greedy()
    assert greedy.is_greedy and not SamplerSettings().is_greedy
    assert torch.equal(sample(logits, [row(greedy, seed=None)] * 5), logits.argmax(-1))
    # A sampled row in the batch forces the general path; greedy rows must still be argmax.
    rows = [row(greedy, seed=None)] * 4 + [row(SamplerSettings(temperature=1.0))]
    assert torch.equal(sample(logits, rows)[:4], logits[:4].argmax(-1))


def test_greedy_with_repetition_penalty_avoids_prompt_token():
    logits = torch.tensor([[3.0, 2.0, 0.5, -1.0]])
    settings = SamplerSettings(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [row(settings, seed=None)]).item() == 0  # nothing seen: plain argmax
    assert sample(logits, [row(settings, seed=None, prompt=[2])]).item() == 0
    assert sample(logits, [row(settings, seed=None, prompt=[0])]).item() == 1  # 3 / 2 = 1.5 < 2
    assert sample(logits, [row(settings, seed=None, output=[0])]).item() == 1  # generated ids count too


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # Row 0: dividing keeps token 0 (3/1.3 = 2.31 > 2.2); subtracting would pick 1 (1.7 < 2.2).
    # Row 1: multiplying picks 1 (-1.3 < -1.2); dividing would keep 0 (-0.77 > -1.2).
    logits = torch.tensor([[3.0, 2.2], [-1.0, -1.2]])
    settings = SamplerSettings(temperature=0.0, repetition_penalty=1.3)
    rows = [row(settings, seed=None, prompt=[0]), row(settings, seed=None, prompt=[0])]
    assert sample(logits, rows).tolist() == [0, 1]
    # The exact values, through the distribution a sampled row would use.
    sampled = SamplerSettings(repetition_penalty=1.3)
    x = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    probs = probabilities(x, [row(sampled, prompt=[0, 1], output=[1])])
    expected = torch.softmax(torch.tensor([[2.0 / 1.3, -1.0 * 1.3, 0.5, 1.0]]), -1)
    torch.testing.assert_close(probs, expected)


def test_frequency_counts_occurrences_presence_does_not_and_prompt_is_ignored():
    logits = torch.zeros(2, 4)
    output = [0, 0, 0, 1]
    rows = [
        row(SamplerSettings(frequency_penalty=0.5), prompt=[2, 2], output=output),
        row(SamplerSettings(presence_penalty=0.5), prompt=[2, 2], output=output),
    ]
    probs = probabilities(logits, rows)
    freq = torch.softmax(torch.tensor([-1.5, -0.5, 0.0, 0.0]), -1)
    presence = torch.softmax(torch.tensor([-0.5, -0.5, 0.0, 0.0]), -1)
    torch.testing.assert_close(probs[0], freq)
    torch.testing.assert_close(probs[1], presence)


def test_penalties_ignore_ids_outside_the_vocabulary():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    settings = SamplerSettings(repetition_penalty=2.0, frequency_penalty=1.0)
    probs = probabilities(logits, [row(settings, prompt=[3, 1000, -1], output=[7])])
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_top_k_1_is_argmax_even_at_high_temperature():
    logits = torch.randn(64, 30, generator=gen(2))
    rows = [row(SamplerSettings(temperature=100.0, top_k=1), seed=s) for s in range(64)]
    assert torch.equal(sample(logits, rows), logits.argmax(-1))


def test_top_k_support_is_exactly_the_k_most_likely_tokens():
    logits = torch.tensor([0.0, 2.0, 1.0, 2.5, 1.5, 0.5, 1.8, 0.2])
    settings = SamplerSettings(top_k=3)
    top3 = {3, 1, 6}
    assert support_over_seeds(logits, settings) == top3
    assert support_of_probs(probabilities(logits[None], [row(settings)])[0]) == top3
    assert len(support_over_seeds(logits, SamplerSettings())) > 3  # the filter is what limits it


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.8, {0, 1}), (0.81, {0, 1, 2}), (0.3, {0}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_minimal_nucleus(top_p, nucleus):
    settings = SamplerSettings(top_p=top_p)
    assert support_of_probs(probabilities(NUCLEUS[None], [row(settings)])[0]) == nucleus
    assert support_over_seeds(NUCLEUS, settings) == nucleus


def test_top_p_round_off_does_not_add_a_token():
    # Five of fifty equal tokens hold exactly 0.1, but their fp32 cumulative sum lands just
    # below 0.1; a strict comparison would let a sixth token into the nucleus.
    settings = SamplerSettings(top_p=0.1)
    probs = probabilities(torch.zeros(1, 50), [row(settings)])[0]
    assert support_of_probs(probs) == {0, 1, 2, 3, 4}  # equal logits: the lowest ids win


def test_top_p_renormalizes_the_nucleus():
    probs = probabilities(NUCLEUS[None], [row(SamplerSettings(top_p=0.8))])[0]
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


@pytest.mark.parametrize(("min_p", "kept"), [(0.25, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0}), (0.0, {0, 1, 2, 3})])
def test_min_p_keeps_tokens_above_a_fraction_of_the_max(min_p, kept):
    settings = SamplerSettings(min_p=min_p)
    assert support_of_probs(probabilities(NUCLEUS[None], [row(settings)])[0]) == kept
    assert support_over_seeds(NUCLEUS, settings) == kept


def test_banned_ids_are_never_drawn_and_greedy_skips_them():
    logits = torch.tensor([5.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    banned = (0, 1)
    assert support_over_seeds(logits, SamplerSettings(banned_token_ids=banned)) == {2, 3, 4, 5}
    greedy = SamplerSettings(temperature=0.0, banned_token_ids=banned, token_bias={1: 50.0})
    assert sample(logits[None], [row(greedy, seed=None)]).item() == 2  # a bias cannot revive a ban


def test_allowed_token_ids_are_the_only_tokens_drawn_and_a_bias_cannot_leave_them():
    logits = torch.tensor([5.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    allowed = SamplerSettings(allowed_token_ids=(2, 4, 5))
    assert support_over_seeds(logits, allowed) == {2, 4, 5}
    greedy = SamplerSettings(temperature=0.0, allowed_token_ids=(3, 4), token_bias={0: 50.0, 4: 1.0})
    assert sample(logits[None], [row(greedy, seed=None)]).item() == 4
    with pytest.raises(SamplerSettingsError, match="allowed_token_ids contains 9"):
        SamplerSettings(allowed_token_ids=(9,)).validate(6)


@pytest.mark.parametrize("top_a", [0.2, 0.5, 0.9])
def test_top_a_keeps_tokens_above_top_a_times_the_peak_squared(top_a: float):
    logits = torch.tensor([2.0, 1.6, 1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits, dim=-1)
    reference = {i for i, p in enumerate(probs.tolist()) if p >= top_a * float(probs.max()) ** 2}
    settings = SamplerSettings(temperature=1.0, top_a=top_a)
    assert support_of_probs(probabilities(logits[None], [row(settings)])[0]) == reference
    assert support_over_seeds(logits, settings) <= reference
    with_top_k = SamplerSettings(temperature=1.0, top_k=3, top_a=top_a)  # over the renormalized top 3
    kept = torch.softmax(logits[:3], dim=-1)
    expected = {i for i, p in enumerate(kept.tolist()) if p >= top_a * float(kept.max()) ** 2}
    assert support_of_probs(probabilities(logits[None], [row(with_top_k)])[0]) == expected


def test_token_bias_can_force_a_token():
    logits = torch.randn(8, generator=gen(3))
    forced = int(logits.argmin())
    assert support_over_seeds(logits, SamplerSettings(temperature=2.0, token_bias={forced: 100.0})) == {forced}


def test_suppress_ids_block_a_token():
    logits = torch.tensor([[9.0, 0.0, 0.0]])
    assert sample(logits, [row(SamplerSettings.greedy(), seed=None, suppress=[0])]).item() in {1, 2}
    n = 200
    rows = [row(SamplerSettings(), seed=s, suppress=[0]) for s in range(n)]
    assert 0 not in sample(logits.expand(n, -1), rows).tolist()


def test_same_seed_repeats_and_different_seeds_differ():
    logits = torch.zeros(1, 50)
    settings = SamplerSettings()

    def draws(seed: int) -> list[int]:
        """The job's tokens 0..19: one seed's stream, draw index by draw index."""
        return [sample(logits, [row(settings, seed=seed, draw=n)]).item() for n in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_a_rows_draws_do_not_depend_on_its_batch():
    vocab, steps = 32, 12
    logits = torch.randn(steps, 4, vocab, generator=gen(4))
    probe_settings = [SamplerSettings(temperature=0.9), SamplerSettings(top_k=5, top_p=0.9, min_p=0.05)]
    others = [SamplerSettings.greedy(), SamplerSettings(top_p=0.5, presence_penalty=1.0),
              SamplerSettings(temperature=1.5, banned_token_ids=(3,))]
    for probe in probe_settings:
        alone, batched, outputs = [], [], []
        for t in range(steps):
            probe_logits = logits[t, 2:3]
            alone.append(sample(probe_logits, [row(probe, seed=11, prompt=[1], output=outputs)]).item())
            rows = [row(s, seed=100 + t + j, prompt=[1]) for j, s in enumerate(others)]
            rows.insert(2, row(probe, seed=11, prompt=[1], output=outputs))
            batch_logits = torch.cat([logits[t, :2], probe_logits, logits[t, 3:]])
            batched.append(sample(batch_logits, rows)[2].item())
            outputs.append(alone[-1])
        assert alone == batched


@pytest.mark.parametrize(
    "settings",
    [SamplerSettings(), SamplerSettings(temperature=0.5, top_k=6)],
    ids=["plain", "sorted-top_k"],
)
def test_empirical_frequencies_match_the_distribution(settings):
    vocab, n = 8, 20000
    logits = torch.randn(vocab, generator=gen(5))
    z = logits / settings.temperature
    if settings.top_k:
        z = z.masked_fill(z < z.topk(settings.top_k).values[-1], -math.inf)
    expected = torch.softmax(z, -1)
    draws = sample(logits.expand(n, -1), [row(settings, seed=s) for s in range(n)])
    observed = torch.bincount(draws, minlength=vocab).double()
    kept = expected > 0
    assert observed[~kept].sum() == 0
    exp_counts = expected[kept].double() * n
    chi2 = float(((observed[kept] - exp_counts) ** 2 / exp_counts).sum())
    # dof <= 7; the 0.999 quantile of chi-square(7) is 24.3. An off-by-one in the CDF
    # lookup or a missing temperature gives a statistic in the thousands.
    assert chi2 < 35.0, chi2


def test_mixed_batch_rows_follow_their_own_settings():
    logits = torch.tensor([
        [1.0, 3.0, 2.0, 0.0],
        [1.0, 3.0, 2.0, 0.0],
        [1.0, 3.0, 2.0, 0.0],
        [1.0, 3.0, 2.0, 0.0],
    ])
    n_rep = 50

    def rows(seed: int) -> list:
        return [
            row(SamplerSettings.greedy(), seed=None),
            row(SamplerSettings(temperature=0.0, repetition_penalty=10.0), seed=None, prompt=[1]),
            row(SamplerSettings(temperature=5.0, top_k=1, banned_token_ids=(1,)), seed=seed),
            row(SamplerSettings(temperature=1.0, token_bias={3: 100.0}), seed=seed),
        ]

    for rep in range(n_rep):
        assert sample(logits, rows(rep)).tolist() == [1, 2, 2, 3]
    probs = probabilities(logits, rows(0))
    assert probs[:3].argmax(-1).tolist() == [1, 2, 2] and probs[3, 3] > 0.99


def test_sampling_probs_rows_sum_to_one_and_greedy_rows_are_one_hot():
    logits = torch.randn(4, 20, generator=gen(6))
    rows = [
        row(SamplerSettings.greedy(), seed=None),
        row(SamplerSettings(temperature=0.7, top_p=0.9)),
        row(SamplerSettings(min_p=0.1, frequency_penalty=0.5), output=[1, 1]),
        row(SamplerSettings(temperature=0.0, banned_token_ids=(int(logits[3].argmax()),)), seed=None),
    ]
    probs = probabilities(logits, rows)
    assert probs.shape == (4, 20) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    second_best = int(logits[3].topk(2).indices[1])
    for i, token in ((0, int(logits[0].argmax())), (3, second_best)):
        assert torch.equal(probs[i], torch.nn.functional.one_hot(torch.tensor(token), 20).float())
    fast = probabilities(logits, [row(SamplerSettings.greedy(), seed=None)] * 4)
    assert torch.equal(fast.argmax(-1), logits.argmax(-1)) and torch.equal(fast.sum(-1), torch.ones(4))


def test_low_precision_logits_give_int64_ids_and_leave_input_untouched():
    logits = torch.randn(3, 16, generator=gen(7)).to(torch.bfloat16)
    before = logits.clone()
    rows = [row(SamplerSettings(repetition_penalty=1.5, banned_token_ids=(0,)), prompt=[1, 2]) for _ in range(3)]
    ids = sample(logits, rows)
    assert ids.dtype == torch.int64 and ids.shape == (3,)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"temperature": -0.1}, "temperature must be in [0, 100]"),
        ({"temperature": 101}, "temperature must be in [0, 100]"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3"),
        ({"token_bias": {4: math.inf}}, "token_bias[4] must be a finite number"),
        ({"token_bias": {-2: 1.0}}, "token_bias key must be a token id >= 0, got -2"),
        ({"banned_token_ids": (-1,)}, "banned_token_ids entry must be a token id >= 0, got -1"),
    ],
)
def test_invalid_settings_name_the_field_and_limit(kwargs, message):
    with pytest.raises(SamplerSettingsError) as info:
        SamplerSettings(**kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validate_rejects_ids_outside_the_vocabulary(llama_dir: Path):
    SamplerSettings(banned_token_ids=(49,), token_bias={0: 1.0}).validate(50)
    with pytest.raises(SamplerSettingsError, match=r"banned_token_ids contains 50, outside the vocabulary \[0, 50\)"):
        SamplerSettings(banned_token_ids=(50,)).validate(50)
    with pytest.raises(SamplerSettingsError, match=r"token_bias key 99 is outside the vocabulary \[0, 50\)"):
        SamplerSettings(token_bias={99: 1.0}).validate(50)
    # the generator's admission is where a job's settings meet the model's vocabulary
    generator = Generator.from_pretrained(llama_dir, cache_tokens=256, page_size=8)
    vocab = generator.model.config.vocab_size
    refused = f"gen_settings: banned_token_ids contains {vocab + 10}, outside the vocabulary"
    with pytest.raises(JobRejected, match=refused):
        generator.enqueue(Job([5, 6], 4, gen_settings=SamplerSettings(banned_token_ids=(vocab + 10,))))
    with pytest.raises(JobRejected, match=rf"stop_conditions contains token id {vocab}, outside the vocabulary"):
        generator.enqueue(Job([5, 6], 4, stop_conditions=[2, vocab]))  # a stop token suppressed by min_new_tokens
    assert generator.num_remaining_jobs() == 0


def test_settings_are_hashable_and_normalized():
    a = SamplerSettings(temperature=1, token_bias={3: 1, 1: -2.0}, banned_token_ids=[5, 2])
    b = SamplerSettings(temperature=1.0, token_bias={1: -2.0, 3: 1.0}, banned_token_ids=(5, 2))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.token_bias[3] == 1.0 and isinstance(a.temperature, float)
    assert SamplerSettings() == SamplerSettings(token_bias={})


def test_masking_every_token_raises_a_named_error_instead_of_nan():
    """Such a row draws -1 (its job alone fails); raise_for_row names why."""
    cases = [(torch.zeros(1, 4), row(SamplerSettings(banned_token_ids=(0, 1)), suppress=[2, 3]),
              "banned_token_ids and suppress_ids"),
             (torch.full((1, 4), math.nan), row(SamplerSettings(top_k=2)), "model's logits")]
    for logits, spec, cause in cases:
        sampler = BatchSampler(1, 4, CPU)
        assert sampler.sample(logits, sample_rows([spec])).tolist() == [-1]
        with pytest.raises(EmptyDistributionError, match=cause):
            sampler.raise_for_row(0)
