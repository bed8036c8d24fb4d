"""Properties of PowerSGD (shardengine.distributed.compression.powersgd), N ranks simulated in one process."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from shardengine.distributed.traffic import ring_bytes
from shardengine.errors import ConfigError
from shardengine.distributed.compression.powersgd import PowerSGDState, plan_powersgd, simulate_powersgd_all_reduce

dims = st.integers(min_value=1, max_value=6)
shapes = st.one_of(st.tuples(), st.tuples(dims), st.tuples(dims, dims), st.tuples(dims, dims, dims))
shape_lists = st.lists(shapes, min_size=1, max_size=4)
worlds = st.integers(min_value=1, max_value=4)


def random_grads(shape_list, world: int, seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shape_list] for _ in range(world)]


def exact_sums(grads_per_rank) -> list[torch.Tensor]:
    return [sum(column) for column in zip(*grads_per_rank)]


@given(shape_list=shape_lists, world=worlds, steps=st.integers(min_value=1, max_value=3),
       warm_start=st.booleans(), error_feedback=st.booleans(), seed=st.integers(0, 2**16))
def test_full_rank_is_exact(shape_list, world, steps, warm_start, error_feedback, seed) -> None:
    plan = plan_powersgd(shape_list, rank=64, min_compression_rate=0)  # compress every matrix, at full rank
    states = [PowerSGDState(plan, seed=1, warm_start=warm_start, error_feedback=error_feedback)
              for _ in range(world)]
    for step in range(steps):
        grads = random_grads(shape_list, world, seed + step)
        for result, exact in zip(simulate_powersgd_all_reduce(states, grads), exact_sums(grads)):
            assert torch.allclose(result, exact, rtol=1e-4, atol=1e-4)


@given(shape_list=shape_lists, rank=st.integers(1, 4), rate=st.sampled_from([0.0, 1.0, 2.0, 4.0]), world=worlds)
def test_plan_compresses_only_matrices_that_save_enough_and_counts_their_bytes(shape_list, rank, rate, world) -> None:
    plan = plan_powersgd(shape_list, rank, rate)
    assert sorted([m.index for m in plan.matrices] + list(plan.dense)) == list(range(len(shape_list)))
    for m in plan.matrices:
        shape = shape_list[m.index]
        rows, cols = shape[0], math.prod(shape[1:])
        assert len(shape) >= 2 and (m.rows, m.cols) == (min(rows, cols), max(rows, cols))
        assert m.rank == min(rank, m.rows) and (m.rows + m.cols) * m.rank * rate < rows * cols
    for index in plan.dense:  # 1-D, scalars and empty tensors always; matrices that would not save enough
        shape = shape_list[index]
        if len(shape) >= 2 and math.prod(shape):
            short, long = sorted((shape[0], math.prod(shape[1:])))
            assert (short + long) * min(rank, short) * rate >= short * long
    assert plan.p_numel + plan.q_numel == sum((m.rows + m.cols) * m.rank for m in plan.matrices)
    expected = sum(ring_bytes("all_reduce", 4 * n, world) for n in (plan.p_numel, plan.q_numel, plan.dense_numel))
    assert plan.wire_bytes(world) == expected
    if not plan.matrices:
        assert plan.wire_bytes(world) == plan.uncompressed_bytes(world)


def test_wire_bytes_for_a_large_matrix_are_m_plus_n_times_r_instead_of_m_times_n() -> None:
    plan = plan_powersgd([(1024, 4096), (4096,)], rank=4)
    assert plan.p_numel + plan.q_numel == (1024 + 4096) * 4
    assert plan.wire_bytes(world=4) == ring_bytes("all_reduce", 4 * (1024 * 4 + 4096 * 4), 4) + ring_bytes(
        "all_reduce", 4 * 4096, 4)
    assert plan.uncompressed_bytes(world=4) == ring_bytes("all_reduce", 4 * (1024 * 4096 + 4096), 4)


@given(shape_list=shape_lists, world=worlds, steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_error_feedback_applied_total_is_the_true_total_minus_the_ranks_errors(shape_list, world, steps, seed) -> None:
    plan = plan_powersgd(shape_list, rank=1, min_compression_rate=0)
    states = [PowerSGDState(plan, seed=3) for _ in range(world)]
    applied = [torch.zeros(shape) for shape in shape_list]
    truth = [torch.zeros(shape) for shape in shape_list]
    for step in range(steps):
        grads = random_grads(shape_list, world, seed + step)
        applied = [a + r for a, r in zip(applied, simulate_powersgd_all_reduce(states, grads))]
        truth = [t + e for t, e in zip(truth, exact_sums(grads))]
    for m in plan.matrices:
        owed = sum(state.errors[m.index] for state in states)
        owed = (owed.T if m.transposed else owed).reshape(shape_list[m.index])
        assert torch.allclose(applied[m.index] + owed, truth[m.index], atol=1e-4 * steps * world)
    for index in plan.dense:
        assert torch.allclose(applied[index], truth[index], atol=1e-5 * steps * world)


@given(shape=st.tuples(st.integers(2, 8), st.integers(2, 8)), rank=st.integers(1, 3), world=worlds,
       seed=st.integers(0, 2**16))
def test_the_approximation_is_a_projection_of_the_sum_so_never_larger(shape, rank, world, seed) -> None:
    plan = plan_powersgd([shape], rank, min_compression_rate=0)
    states = [PowerSGDState(plan, seed=seed, error_feedback=False) for _ in range(world)]
    grads = random_grads([shape], world, seed)
    result, exact = simulate_powersgd_all_reduce(states, grads)[0], exact_sums(grads)[0]
    assert result.norm() <= exact.norm() * (1 + 1e-5) + 1e-6


def test_warm_start_converges_to_the_best_rank_r_approximation_of_a_steady_gradient() -> None:
    # A 6x8 matrix with singular values 10, 1, 0.1: the best rank-1 error is sqrt(1 + 0.01).
    generator = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(6, 3, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(8, 3, generator=generator))
    gradient = u @ torch.diag(torch.tensor([10.0, 1.0, 0.1])) @ v.T
    best = math.sqrt(1 + 0.01)
    plan = plan_powersgd([(6, 8)], rank=1, min_compression_rate=0)
    warm, cold = PowerSGDState(plan, seed=5, error_feedback=False), PowerSGDState(
        plan, seed=5, error_feedback=False, warm_start=False)
    warm_errors = [(simulate_powersgd_all_reduce([warm], [[gradient]])[0] - gradient).norm().item() for _ in range(6)]
    cold_errors = [(simulate_powersgd_all_reduce([cold], [[gradient]])[0] - gradient).norm().item() for _ in range(6)]
    assert warm_errors[-1] == pytest.approx(best, rel=1e-4)
    assert all(error >= best * (1 - 1e-5) for error in warm_errors + cold_errors)  # Eckart-Young
    assert max(cold_errors[1:]) > warm_errors[-1] * (1 + 1e-3)  # a fresh Q each step keeps the first-step error


def test_same_seed_means_the_same_starting_q_on_every_rank() -> None:
    plan = plan_powersgd([(5, 7)], rank=2, min_compression_rate=0)
    grad = [torch.randn(5, 7)]
    assert torch.equal(PowerSGDState(plan, seed=9).compute_p(grad)[0], PowerSGDState(plan, seed=9).compute_p(grad)[0])


def test_zero_gradients_stay_finite() -> None:
    plan = plan_powersgd([(4, 6)], rank=2, min_compression_rate=0)
    states = [PowerSGDState(plan) for _ in range(2)]
    for _ in range(2):
        result = simulate_powersgd_all_reduce(states, [[torch.zeros(4, 6)], [torch.zeros(4, 6)]])[0]
        assert torch.equal(result, torch.zeros(4, 6))


@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_bad_rank_is_a_config_error(rank) -> None:
    with pytest.raises(ConfigError, match="rank"):
        plan_powersgd([(4, 4)], rank=rank)


@pytest.mark.parametrize("rate", [-1, math.inf, math.nan, "2"])
def test_bad_compression_rate_is_a_config_error(rate) -> None:
    with pytest.raises(ConfigError, match="min_compression_rate"):
        plan_powersgd([(4, 4)], min_compression_rate=rate)


def test_gradients_that_do_not_match_the_plan_are_refused() -> None:
    state = PowerSGDState(plan_powersgd([(4, 4), (4,)], min_compression_rate=0))
    with pytest.raises(ValueError, match="shapes"):
        state.compute_p([torch.zeros(4, 4)])
    with pytest.raises(ValueError, match="shapes"):
        state.compute_p([torch.zeros(4, 5), torch.zeros(4)])


def test_steps_out_of_order_are_refused() -> None:
    state = PowerSGDState(plan_powersgd([(4, 4)], min_compression_rate=0))
    with pytest.raises(RuntimeError, match="out of order"):
        state.compute_q([torch.zeros(4, 1)])
    state.compute_p([torch.zeros(4, 4)])
    with pytest.raises(RuntimeError, match="next expected: q"):
        state.compute_p([torch.zeros(4, 4)])
