"""Properties of ProportionalSampler and of the proportion math (shardengine.data); no process group."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given, strategies as st

import shardengine as se
from shardengine.errors import ConfigError
from shardengine.data.proportions import proportional_counts, rebalance_proportions
from shardengine.data.sampler import ProportionalSampler


@st.composite
def proportion_lists(draw, min_size: int = 1, max_size: int = 6, allow_zero: bool = True):
    """Shares summing to 1 (as floats), some of them possibly 0."""
    weights = draw(st.lists(st.integers(min_value=0 if allow_zero else 1, max_value=20),
                            min_size=min_size, max_size=max_size))
    assume(sum(weights) > 0)
    return [w / sum(weights) for w in weights]


sizes = st.integers(min_value=0, max_value=300)


def samplers(n: int, proportions, **options) -> list[ProportionalSampler]:
    return [ProportionalSampler(range(n), proportions, rank=r, num_replicas=len(proportions), **options)
            for r in range(len(proportions))]


# --------------------------------------------------------------------------- coverage and counts


@given(n=sizes, proportions=proportion_lists(), shuffle=st.booleans(), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 100))
def test_every_sample_is_seen_exactly_once_per_epoch_across_ranks(n, proportions, shuffle, seed, epoch) -> None:
    ranks = samplers(n, proportions, shuffle=shuffle, seed=seed)
    for sampler in ranks:
        sampler.set_epoch(epoch)
    drawn = [list(sampler) for sampler in ranks]
    assert sorted(i for indices in drawn for i in indices) == list(range(n))
    for sampler, indices in zip(ranks, drawn):
        assert len(sampler) == len(indices)


@given(n=sizes, proportions=proportion_lists())
def test_counts_are_within_one_of_each_quota_and_a_zero_share_gets_nothing(n, proportions) -> None:
    counts = proportional_counts(n, proportions)
    assert sum(counts) == n
    for count, share in zip(counts, proportions):
        assert abs(count - share * n) < 1 + 1e-9
        if share == 0:
            assert count == 0


@given(n=sizes, proportions=proportion_lists())
def test_largest_remainder_gives_the_extra_samples_to_the_largest_fractions(n, proportions) -> None:
    counts = proportional_counts(n, proportions)
    quotas = [Fraction(p).limit_denominator(10**9) * n for p in proportions]
    quotas = [q / sum(Fraction(p).limit_denominator(10**9) for p in proportions) for q in quotas]
    rounded_up = [r for r, (c, q) in enumerate(zip(counts, quotas)) if c > math.floor(q)]
    kept_down = [r for r, (c, q) in enumerate(zip(counts, quotas)) if c == math.floor(q) and q != c]
    for up in rounded_up:  # no rank left at its floor had a larger fraction
        assert all(quotas[down] - math.floor(quotas[down]) <= quotas[up] - math.floor(quotas[up]) for down in kept_down)


@given(n=sizes, proportions=proportion_lists(), seed=st.integers(0, 1000))
def test_drop_last_takes_the_floor_of_each_quota_and_never_repeats(n, proportions, seed) -> None:
    ranks = samplers(n, proportions, seed=seed, drop_last=True)
    drawn = [i for sampler in ranks for i in sampler]
    assert len(drawn) == len(set(drawn)) and set(drawn) <= set(range(n))
    assert n - len(drawn) < len(proportions)
    for sampler, share in zip(ranks, proportions):
        assert len(sampler) <= share * n + 1e-9


def test_decimal_shares_round_the_way_they_read() -> None:
    assert proportional_counts(10, [.7, .3]) == [7, 3]
    assert proportional_counts(10, [.7, .3], drop_last=True) == [7, 3]  # 0.7 * 10 is 7, not 6.999...
    assert proportional_counts(100, [.25, .25, .10, .40]) == [25, 25, 10, 40]
    assert proportional_counts(3, [1 / 3] * 3) == [1, 1, 1]


# --------------------------------------------------------------------------- determinism and epochs


@given(n=sizes, proportions=proportion_lists(), seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_the_same_seed_and_epoch_give_the_same_indices(n, proportions, seed, epoch) -> None:
    first, second = samplers(n, proportions, seed=seed), samplers(n, proportions, seed=seed)
    for a, b in zip(first, second):
        a.set_epoch(epoch), b.set_epoch(epoch)
        assert list(a) == list(b) == list(a)


def test_epochs_reshuffle_and_shuffle_false_keeps_dataset_order() -> None:
    sampler = ProportionalSampler(range(100), [.6, .4], seed=3, rank=0, num_replicas=2)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and len(list(sampler)) == 60
    ordered = ProportionalSampler(range(10), [.6, .4], shuffle=False, rank=1, num_replicas=2)
    assert list(ordered) == [6, 7, 8, 9]


def test_equal_shares_by_default_and_rank_and_world_from_the_process_group() -> None:
    sampler = ProportionalSampler(range(7))  # no process group: rank 0 of 1
    assert (sampler.rank, sampler.num_replicas, sampler.proportions) == (0, 1, (1.0,))
    assert sorted(sampler) == list(range(7))
    assert [len(ProportionalSampler(range(7), rank=r, num_replicas=3)) for r in range(3)] == [3, 2, 2]


@given(n=sizes, before=proportion_lists(min_size=3, max_size=3), after=proportion_lists(min_size=3, max_size=3))
def test_set_proportions_takes_effect_at_the_next_epoch_and_keeps_coverage(n, before, after) -> None:
    ranks = samplers(n, before)
    iterators = [iter(sampler) for sampler in ranks]  # an epoch already under way keeps its shares
    for sampler in ranks:
        sampler.set_proportions(after)
        sampler.set_epoch(1)
    assert sorted(i for it in iterators for i in it) == list(range(n))
    assert [len(s) for s in ranks] == proportional_counts(n, after)
    assert sorted(i for sampler in ranks for i in sampler) == list(range(n))


def test_the_sampler_feeds_a_dataloader_and_is_exported() -> None:
    assert se.data.ProportionalSampler is ProportionalSampler and se.data.rebalance_proportions is rebalance_proportions
    dataset = torch.utils.data.TensorDataset(torch.arange(30))
    loaders = [torch.utils.data.DataLoader(dataset, batch_size=4, sampler=s)
               for s in samplers(30, [.25, .25, .10, .40])]
    seen = sorted(int(i) for loader in loaders for (batch,) in loader for i in batch)
    assert seen == list(range(30))


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("proportions,message", [
    ([.5, .4], "sum to 1"), ([.5, .5, 0], "3 entries for 2 ranks"), ([1.5, -.5], "finite and >= 0"),
    ([math.nan, 1.0], "finite and >= 0"), ([math.inf, 0], "finite and >= 0"), ([True, False], "number"),
    (["a", "b"], "number"), ("auto", "sequence"), (0.5, "sequence"), ([0, 0], "sum to 1")])
def test_bad_proportions_are_config_errors_that_say_what_is_wrong(proportions, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ProportionalSampler(range(10), proportions, rank=0, num_replicas=2)
    sampler = ProportionalSampler(range(10), rank=0, num_replicas=2)
    with pytest.raises(ConfigError, match=message):
        sampler.set_proportions(proportions)


@pytest.mark.parametrize("options,message", [
    ({"rank": 2, "num_replicas": 2}, "rank must be"), ({"rank": -1, "num_replicas": 2}, "rank must be"),
    ({"rank": 0, "num_replicas": 0}, "num_replicas"), ({"rank": 0, "num_replicas": 1.5}, "num_replicas")])
def test_bad_rank_or_world_is_a_config_error(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ProportionalSampler(range(10), **options)


def test_a_dataset_without_a_length_is_refused() -> None:
    with pytest.raises(ConfigError, match="length"):
        ProportionalSampler(iter(range(10)), rank=0, num_replicas=1)


@pytest.mark.parametrize("call", [lambda p: proportional_counts(10, p),
                                  lambda p: rebalance_proportions(p, step_times=[1.0])])
def test_the_pure_functions_check_proportions_too(call) -> None:
    with pytest.raises(ConfigError, match="sequence of numbers"):
        call(0.5)
    with pytest.raises(ConfigError, match="sum to 1"):
        call([0.5])


@pytest.mark.parametrize("total", [-1, 2.5, True, None])
def test_proportional_counts_refuses_a_bad_total(total) -> None:
    with pytest.raises(ConfigError, match="total"):
        proportional_counts(total, [1.0])


def test_sum_tolerance_accepts_float_noise() -> None:
    assert len(ProportionalSampler(range(10), [0.1] * 10, rank=9, num_replicas=10)) == 1  # sums to 0.9999999999999999


# --------------------------------------------------------------------------- re-balancing


speeds_lists = st.lists(st.floats(min_value=0.1, max_value=100), min_size=1, max_size=6)


def busy_times(proportions, speeds) -> list[float]:
    """Seconds each rank works for its share at its speed (share per second)."""
    return [p / s for p, s in zip(proportions, speeds)]


@given(proportions=proportion_lists(), speeds_seed=st.integers(0, 1000), smoothing=st.floats(0, 0.99),
       floor=st.floats(0, 1))
def test_rebalanced_shares_sum_to_one_respect_the_floor_and_are_valid_proportions(
        proportions, speeds_seed, smoothing, floor) -> None:
    speeds = torch.rand(len(proportions), generator=torch.Generator().manual_seed(speeds_seed)).add(0.1).tolist()
    times = [t if p > 0 else 0.0 for p, t in zip(proportions, busy_times(proportions, speeds))]
    new = rebalance_proportions(proportions, times, smoothing=smoothing, floor=floor)
    assert len(new) == len(proportions) and abs(sum(new) - 1) < 1e-9
    assert min(new) >= floor / len(new) - 1e-12
    ProportionalSampler(range(5), new, rank=0, num_replicas=len(new))  # accepted as they are


@given(proportions=proportion_lists(allow_zero=False), speeds=st.data())
def test_without_smoothing_or_floor_every_rank_would_finish_together(proportions, speeds) -> None:
    speed = speeds.draw(st.lists(st.floats(0.1, 100), min_size=len(proportions), max_size=len(proportions)))
    new = rebalance_proportions(proportions, busy_times(proportions, speed), smoothing=0, floor=0)
    predicted = busy_times(new, speed)
    assert max(predicted) == pytest.approx(min(predicted), rel=1e-9)


@given(proportions=proportion_lists(allow_zero=False), speeds=st.data(), smoothing=st.floats(0, 0.99))
def test_a_rebalance_never_makes_the_slowest_rank_slower(proportions, speeds, smoothing) -> None:
    speed = speeds.draw(st.lists(st.floats(0.1, 100), min_size=len(proportions), max_size=len(proportions)))
    new = rebalance_proportions(proportions, busy_times(proportions, speed), smoothing=smoothing, floor=0)
    assert max(busy_times(new, speed)) <= max(busy_times(proportions, speed)) * (1 + 1e-9)


@given(speed=speeds_lists)
def test_repeated_rebalancing_from_equal_shares_converges_to_equal_times(speed) -> None:
    shares = [1 / len(speed)] * len(speed)
    for _ in range(60):
        shares = rebalance_proportions(shares, busy_times(shares, speed), smoothing=0.5, floor=0)
    times = busy_times(shares, speed)
    assert max(times) == pytest.approx(min(times), rel=1e-6)


@given(proportions=proportion_lists(allow_zero=False), smoothing=st.floats(0, 0.99))
def test_balanced_ranks_keep_their_shares(proportions, smoothing) -> None:
    new = rebalance_proportions(proportions, [2.0] * len(proportions), smoothing=smoothing, floor=0)
    assert new == pytest.approx(proportions, abs=1e-12)


def test_throughputs_give_shares_proportional_to_speed() -> None:
    assert rebalance_proportions([.5, .5], throughputs=[300, 100], smoothing=0) == pytest.approx([.75, .25])


def test_a_rank_with_share_zero_gets_the_floor_unless_the_floor_is_zero() -> None:
    with_floor = rebalance_proportions([.5, .5, 0], [1.0, 1.0, 0.0], smoothing=0, floor=0.3)
    assert with_floor[2] == pytest.approx(0.1) and sum(with_floor) == pytest.approx(1)
    assert rebalance_proportions([.5, .5, 0], [1.0, 1.0, 0.0], smoothing=0, floor=0)[2] == 0


def test_a_very_slow_rank_is_held_at_the_floor() -> None:
    new = rebalance_proportions([.5, .5], [1.0, 1000.0], smoothing=0, floor=0.2)
    assert new == pytest.approx([0.9, 0.1])


@pytest.mark.parametrize("kwargs,message", [
    ({"step_times": [1.0]}, "1 entries for 2 ranks"), ({"step_times": [1.0, -1.0]}, "finite and >= 0"),
    ({"step_times": [1.0, math.nan]}, "finite and >= 0"), ({"step_times": [1.0, 0.0]}, "step time of 0"),
    ({}, "exactly one"), ({"step_times": [1, 1], "throughputs": [1, 1]}, "exactly one"),
    ({"throughputs": [0, 0]}, "no rank did measurable work"), ({"step_times": [1, 1], "smoothing": 1}, "smoothing"),
    ({"step_times": [1, 1], "floor": 1.5}, "floor"), ({"step_times": ["x", 1]}, "number")])
def test_bad_measurements_or_settings_are_config_errors(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        rebalance_proportions([.5, .5], **kwargs)
