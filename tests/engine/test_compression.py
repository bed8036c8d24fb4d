"""Properties of the compressed-collective math (shardengine/distributed/compression/codecs.py), N ranks
simulated in one process."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, strategies as st

from shardengine.distributed.traffic import ring_bytes
from shardengine.distributed.compression.codecs import (ErrorFeedback, cast_policy, decode_reduce_scatter,
                                                        dequantize_blockwise, encode_all_gather, encode_low_precision,
                                                        encode_reduce_scatter, error_bound,
                                                        low_precision_reduce_scatter_bytes, pack, payload_bytes,
                                                        quantize_blockwise, quantized_all_gather_bytes,
                                                        quantized_all_reduce_bytes, quantized_reduce_scatter_bytes,
                                                        simulate_low_precision_reduce_scatter,
                                                        simulate_quantized_all_gather, simulate_quantized_all_reduce,
                                                        simulate_quantized_reduce_scatter, split_chunks, unpack)
from shardengine.errors import ConfigError

block_sizes = st.integers(min_value=1, max_value=40)
worlds = st.integers(min_value=1, max_value=5)
# Every finite float32: zeros, subnormals, fp32's max.
any_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
# Gradient-like values whose sums over a few ranks stay finite in fp32.
moderate = st.floats(min_value=-1e4, max_value=1e4, width=32)


def flat(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@st.composite
def per_rank_buffers(draw, elements=moderate, max_chunk: int = 24):
    """(world, list of per-rank flat buffers whose size is a multiple of world)."""
    world = draw(worlds)
    chunk = draw(st.integers(min_value=0, max_value=max_chunk))
    values = draw(st.lists(elements, min_size=world * world * chunk, max_size=world * world * chunk))
    return world, [flat(values[r * world * chunk:(r + 1) * world * chunk]) for r in range(world)]


def block_max(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per element: max |x| over its block (the issue's bound is this / 127)."""
    out = torch.empty(x.numel(), dtype=torch.float64)
    for start in range(0, x.numel(), block_size):
        out[start:start + block_size] = x[start:start + block_size].double().abs().max()
    return out


# --------------------------------------------------------------------------- quantize / dequantize


@given(values=st.lists(any_float32, max_size=200), block_size=block_sizes)
def test_round_trip_error_is_within_half_a_step_and_the_issues_max_over_127(values, block_size) -> None:
    x = flat(values)
    quantized = quantize_blockwise(x, block_size)
    error = (dequantize_blockwise(quantized).double() - x.double()).abs()
    assert torch.all(error <= error_bound(x, block_size).double())
    block_maxima = block_max(x, block_size)
    normal = block_maxima >= torch.finfo(torch.float32).tiny  # max/127 needs a non-subnormal scale
    assert torch.all(error[normal] <= block_maxima[normal] / 127)


@given(values=st.lists(any_float32, max_size=200), block_size=block_sizes)
def test_quantized_layout_values_and_scales(values, block_size) -> None:
    x = flat(values)
    quantized = quantize_blockwise(x, block_size)
    blocks = math.ceil(len(values) / block_size)
    assert quantized.values.dtype == torch.int8 and quantized.values.shape == (len(values),)
    assert quantized.scales.dtype == torch.float32 and quantized.scales.shape == (blocks,)
    assert int(quantized.values.abs().max()) <= 127 if values else True
    expected_scales = [max(abs(v) for v in x[b * block_size:(b + 1) * block_size].tolist()) for b in range(blocks)]
    assert quantized.scales.tolist() == expected_scales
    assert quantized.nbytes == len(values) + 4 * blocks == payload_bytes(len(values), block_size)


def test_zeros_and_empty_come_back_exactly() -> None:
    zeros = quantize_blockwise(torch.zeros(10), block_size=4)
    assert zeros.scales.tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(dequantize_blockwise(zeros), torch.zeros(10))
    empty = quantize_blockwise(torch.zeros(0), block_size=4)
    assert empty.values.numel() == 0 and empty.scales.numel() == 0 and dequantize_blockwise(empty).numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_quantized_from_their_exact_fp32_values(dtype) -> None:
    x = torch.linspace(-3, 5, 50).to(dtype)
    error = (dequantize_blockwise(quantize_blockwise(x, 16)) - x.float()).abs()
    assert torch.all(error <= error_bound(x, 16))
    assert dequantize_blockwise(quantize_blockwise(x, 16), dtype).dtype == dtype


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_block_arrives_as_nan_and_leaves_the_other_blocks_alone(bad) -> None:
    x = flat([1.0, 2.0, 3.0, bad, 5.0, 0.5, 0.25, 1.0])
    out = dequantize_blockwise(quantize_blockwise(x, block_size=4))
    assert torch.isnan(out[:4]).all()  # never a finite wrong number
    assert torch.all((out[4:] - x[4:]).abs() <= error_bound(x[4:], 4))


@pytest.mark.parametrize("bad_input", [torch.zeros(2, 2), torch.zeros(4, dtype=torch.float64),
                                       torch.zeros(4, dtype=torch.int32), [1.0, 2.0]])
def test_inputs_that_are_not_flat_float_tensors_are_refused(bad_input) -> None:
    with pytest.raises(ValueError, match="tensor"):
        quantize_blockwise(bad_input)


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True, "256"])
def test_bad_block_sizes_are_config_errors(block_size) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        quantize_blockwise(torch.ones(4), block_size)


@given(values=st.lists(any_float32, max_size=100), block_size=block_sizes)
def test_pack_is_one_buffer_of_the_formula_size_and_unpacks_to_the_same_message(values, block_size) -> None:
    quantized = quantize_blockwise(flat(values), block_size)
    buffer = pack(quantized)
    assert buffer.dtype == torch.uint8 and buffer.numel() == payload_bytes(len(values), block_size)
    back = unpack(buffer, len(values), block_size)
    assert torch.equal(back.values, quantized.values) and torch.equal(back.scales, quantized.scales)


def test_unpack_refuses_a_buffer_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="expected 9 uint8 bytes"):
        unpack(torch.zeros(8, dtype=torch.uint8), 5, block_size=8)


# --------------------------------------------------------------------------- error feedback


@given(steps=st.lists(st.lists(moderate, min_size=12, max_size=12), min_size=1, max_size=30),
       block_size=st.integers(min_value=1, max_value=12))
def test_feedback_accumulated_sent_equals_accumulated_truth_minus_a_bounded_residual(steps, block_size) -> None:
    feedback = ErrorFeedback(12)
    sent_total, true_total = torch.zeros(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)
    for values in steps:
        sent_total += dequantize_blockwise(feedback.quantize(flat(values), block_size)).double()
        true_total += flat(values).double()
    largest_input = max(abs(v) for values in steps for v in values)
    rounding = len(steps) * largest_input * 1e-6  # fp32 adds in the residual bookkeeping
    assert torch.allclose(sent_total + feedback.residual.double(), true_total, rtol=0, atol=rounding + 1e-30)
    # |r| <= (max|x| + max|r|) / 254 each step, so |r| <= max|x| / 253 at every k.
    assert float(feedback.residual.abs().max()) <= largest_input / 250 + 1e-30


def test_feedback_removes_the_drift_of_a_value_that_always_rounds_the_same_way() -> None:
    x, steps = flat([1.0, 0.001]), 1000
    plain = sum(dequantize_blockwise(quantize_blockwise(x, 2)) for _ in range(steps))
    feedback = ErrorFeedback(2)
    with_feedback = sum(dequantize_blockwise(feedback.quantize(x, 2)) for _ in range(steps))
    assert plain[1].item() == 0.0  # 0.001 is under half a step of 1/127: lost every time
    assert abs(with_feedback[1].item() - steps * 0.001) <= 1 / 254


def test_feedback_keeps_the_old_residual_where_a_block_was_sent_as_nan() -> None:
    feedback = ErrorFeedback(4)
    feedback.quantize(flat([1.0, 0.001, 1.0, 0.001]), 2)
    before = feedback.residual.clone()
    feedback.quantize(flat([math.inf, 0.0, 1.0, 0.003]), 2)
    assert torch.equal(feedback.residual[:2], before[:2])
    assert torch.isfinite(feedback.residual).all() and not torch.equal(feedback.residual[2:], before[2:])


def test_feedback_rescaled_with_the_loss_scale_matches_feedback_on_unscaled_inputs() -> None:
    inputs = [flat([1.0, 0.3, 0.001, -0.5]) * (1 + step % 4) for step in range(20)]
    scales = [2.0 ** (10 - step // 5) for step in range(20)]  # the loss scale halves every 5 steps
    unscaled, scaled = ErrorFeedback(4), ErrorFeedback(4)
    for step, (x, scale) in enumerate(zip(inputs, scales)):
        if step and scale != scales[step - 1]:
            scaled.rescale(scale / scales[step - 1])
        expected = dequantize_blockwise(unscaled.quantize(x, 4))
        got = dequantize_blockwise(scaled.quantize(x * scale, 4)) / scale
        assert torch.allclose(got, expected, rtol=1e-6, atol=0)


def test_feedback_state_round_trips_and_refuses_a_mismatched_buffer() -> None:
    feedback = ErrorFeedback(3)
    feedback.quantize(flat([1.0, 0.3, 0.001]), 3)
    other = ErrorFeedback(3)
    other.load_state_dict(feedback.state_dict())
    assert torch.equal(other.residual, feedback.residual)
    with pytest.raises(ValueError, match="3 elements"):
        feedback.compensate(torch.zeros(4))
    with pytest.raises(ValueError, match="residual of 2 elements"):
        other.load_state_dict({"residual": torch.zeros(2)})


# --------------------------------------------------------------------------- reduce-scatter


@given(case=per_rank_buffers(), block_size=block_sizes)
def test_quantized_reduce_scatter_is_the_sum_within_the_senders_bounds(case, block_size) -> None:
    world, inputs = case
    reduced = simulate_quantized_reduce_scatter(inputs, block_size)
    for rank, result in enumerate(reduced):
        chunks = [split_chunks(x, world)[rank] for x in inputs]
        exact = sum(chunk.double() for chunk in chunks)
        quantization = sum(error_bound(chunk, block_size).double() for src, chunk in enumerate(chunks) if src != rank)
        rounding = 1e-6 * world * sum(chunk.double().abs() for chunk in chunks)
        assert result.dtype == torch.float32
        assert torch.all((result.double() - exact).abs() <= quantization + rounding)


@given(case=per_rank_buffers(), block_size=block_sizes)
def test_quantized_reduce_scatter_bytes_match_the_messages_sent(case, block_size) -> None:
    world, inputs = case
    numel = inputs[0].numel()
    formula = quantized_reduce_scatter_bytes(numel, world, block_size)
    for rank, x in enumerate(inputs):
        messages = encode_reduce_scatter(x, rank, world, block_size)
        assert messages[rank] is None  # the own chunk never crosses the wire
        assert sum(pack(m).numel() for m in messages if m is not None) == formula
    fp32 = ring_bytes("reduce_scatter", numel * 4, world)
    assert formula <= fp32 // 4 + (world - 1) * 4 * math.ceil(numel / world / block_size)


@given(case=per_rank_buffers(max_chunk=8), steps=st.integers(min_value=1, max_value=12), block_size=block_sizes)
def test_reduce_scatter_with_feedback_accumulates_to_the_true_sum(case, steps, block_size) -> None:
    world, inputs = case
    feedbacks = [ErrorFeedback(x.numel()) for x in inputs]
    sent = [torch.zeros(x.numel() // world, dtype=torch.float64) for x in inputs]
    for step in range(steps):
        step_inputs = [x * (1 + step % 3) for x in inputs]  # a changing signal
        for rank, result in enumerate(simulate_quantized_reduce_scatter(step_inputs, block_size, feedbacks)):
            sent[rank] += result.double()
    largest = max((float(x.abs().max()) for x in inputs if x.numel()), default=0.0) * 3
    for rank in range(world):
        truth = sum(sum(split_chunks(x, world)[rank].double() * (1 + s % 3) for x in inputs) for s in range(steps))
        owed = sum(split_chunks(fb.residual, world)[rank].double() for fb in feedbacks)
        assert torch.allclose(sent[rank] + owed, truth, rtol=0, atol=1e-6 * steps * world * largest + 1e-30)
        assert torch.all(owed.abs() <= world * largest / 250 + 1e-30)
        assert torch.all(split_chunks(feedbacks[rank].residual, world)[rank] == 0)  # own chunk is exact


def test_quantized_reduce_scatter_refuses_buffers_that_do_not_split_evenly() -> None:
    with pytest.raises(ValueError, match="7 elements"):
        simulate_quantized_reduce_scatter([torch.ones(7), torch.ones(7)])
    with pytest.raises(ValueError, match="equal chunks"):
        quantized_reduce_scatter_bytes(7, 2)


# --------------------------------------------------------------------------- all-gather and all-reduce


@given(case=per_rank_buffers(elements=any_float32, max_chunk=12), block_size=block_sizes)
def test_quantized_all_gather_gives_every_rank_the_same_weights_within_the_bound(case, block_size) -> None:
    world, buffers = case
    shards = [split_chunks(x, world)[0] for x in buffers]  # one equal shard per rank
    gathered = simulate_quantized_all_gather(shards, block_size)
    full = torch.cat(shards)
    bound = torch.cat([error_bound(shard, block_size) for shard in shards]).double()
    for copy in gathered:
        assert torch.equal(copy, gathered[0])
        assert torch.all((copy.double() - full.double()).abs() <= bound)
    formula = quantized_all_gather_bytes(full.numel(), world, block_size)
    assert formula == (world - 1) * pack(encode_all_gather(shards[0], block_size)).numel()


@given(case=per_rank_buffers(), block_size=block_sizes)
def test_quantized_all_reduce_agrees_on_every_rank_within_both_phases_bounds(case, block_size) -> None:
    world, inputs = case
    results = simulate_quantized_all_reduce(inputs, block_size)
    reduced = torch.cat(simulate_quantized_reduce_scatter(inputs, block_size))
    exact = sum(x.double() for x in inputs)
    scatter_bound = sum(error_bound(x, block_size).double() for x in inputs)  # loose: counts own chunks too
    gather_bound = torch.cat([error_bound(c, block_size) for c in split_chunks(reduced, world)]).double()
    rounding = 1e-6 * world * sum(x.double().abs() for x in inputs)
    for result in results:
        assert torch.equal(result, results[0])
        assert torch.all((result.double() - exact).abs() <= scatter_bound + gather_bound + rounding)
    numel = inputs[0].numel()
    assert quantized_all_reduce_bytes(numel, world, block_size) == 2 * quantized_reduce_scatter_bytes(
        numel, world, block_size)


def test_all_reduce_with_feedback_on_both_phases_loses_no_drift() -> None:
    inputs, steps = [flat([1.0, 0.001, 0.5, 0.0]), flat([1.0, 0.0, 0.5, 0.002])], 500
    feedbacks = [ErrorFeedback(4) for _ in inputs]
    shard_feedbacks = [ErrorFeedback(2) for _ in inputs]
    total = sum(simulate_quantized_all_reduce(inputs, 2, feedbacks, shard_feedbacks)[0] for _ in range(steps))
    plain = sum(simulate_quantized_all_reduce(inputs, 2)[0] for _ in range(steps))
    exact = steps * (inputs[0] + inputs[1])
    assert (plain - exact).abs().max() > 0.4  # 0.001 and 0.002 vanish every step without feedback
    assert (total - exact).abs().max() < 0.05


def test_all_gather_refuses_unequal_shards() -> None:
    with pytest.raises(ValueError, match="equal shards"):
        simulate_quantized_all_gather([torch.ones(2), torch.ones(3)])


# --------------------------------------------------------------------------- bf16 / fp16


# smallest: half the spacing of the format's subnormals (bf16's go down to 2**-133, fp16's to 2**-24).
@pytest.mark.parametrize("wire,unit_roundoff,smallest", [("bf16", 2.0 ** -8, 2.0 ** -134),
                                                          ("fp16", 2.0 ** -11, 2.0 ** -25)])
@example(case=(2, [torch.tensor([0., 0.]), torch.tensor([2.0071e-41, 0.0])]))  # bf16 flushes it to 0
@given(case=per_rank_buffers())
def test_low_precision_reduce_scatter_rounds_each_value_once_and_sums_in_fp32(
        wire, unit_roundoff, smallest, case) -> None:
    world, inputs = case
    for rank, result in enumerate(simulate_low_precision_reduce_scatter(inputs, wire)):
        chunks = [split_chunks(x, world)[rank].double() for x in inputs]
        exact = sum(chunks)
        cast_error = sum(c.abs() * unit_roundoff + smallest for src, c in enumerate(chunks) if src != rank)
        rounding = 1e-6 * world * sum(c.abs() for c in chunks)
        assert result.dtype == torch.float32
        assert torch.all((result.double() - exact).abs() <= cast_error + rounding)
    numel = inputs[0].numel()
    sent = sum(m.numel() * m.element_size() for m in encode_low_precision(inputs[0], 0, world, cast_policy(wire))
               if m is not None)
    assert low_precision_reduce_scatter_bytes(numel, world, wire) == sent == ring_bytes(
        "reduce_scatter", numel * 2, world)


def test_fp16_overflow_arrives_as_inf_for_the_loss_scaler_to_see() -> None:
    # Rank 0 sends 1e5 (> fp16's 65504) to rank 1; its own 1e5 chunk never leaves it.
    result = simulate_low_precision_reduce_scatter([flat([1e5, 1e5]), flat([1.0, 1.0])], "fp16")
    assert result[0].item() == 1e5 + 1.0
    assert math.isinf(result[1].item())


@pytest.mark.parametrize("wire", ["int8", "fp32", torch.float32, None])
def test_cast_policy_accepts_only_16_bit_floats(wire) -> None:
    with pytest.raises(ConfigError, match="'bf16' or 'fp16'"):
        cast_policy(wire)


def test_cast_policy_accumulates_and_returns_fp32() -> None:
    policy = cast_policy(torch.float16)
    assert (policy.wire, policy.accumulate, policy.result) == (torch.float16, torch.float32, torch.float32)


def test_decode_reduce_scatter_sums_in_rank_order_with_the_own_chunk_exact() -> None:
    own = flat([0.1, 0.2])
    received = [quantize_blockwise(flat([1.0, 0.0])), None]
    assert decode_reduce_scatter(own, received).tolist() == pytest.approx([1.1, 0.2])
