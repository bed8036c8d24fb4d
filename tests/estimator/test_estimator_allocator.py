"""The caching allocator replayed on sizes (memory_estimator/allocator/): its rules as torch's source has
them, a step's tensors as the activation model counts them, and what varying lengths leave cached."""
from __future__ import annotations

import random

import pytest

from memory_estimator.allocator.caching import (LARGE_BUFFER, MIN_BLOCK, ROUND_LARGE, SMALL_BUFFER,
                                                AllocatorOutOfMemory, CachingAllocator, round_size, segment_size)
from memory_estimator.allocator.lengths import LengthDistribution
from memory_estimator.allocator.reserved import records, replay, shape_cache
from memory_estimator.allocator.trace import StepShape, layer_tensors, step_events
from memory_estimator.errors import EstimatorInputError
from memory_estimator.model.stats import Architecture
from memory_estimator.terms.activations import ActivationInputs, activation_profile
from memory_estimator.terms.kernels import loss_bytes

MiB = 2**20
LLAMA = Architecture(layers=4, hidden=512, heads=8, vocab=8000, mlp_width=1376, gated_mlp=True, norm="rmsnorm",
                     dropout=False)


def test_sizes_are_rounded_and_segments_sized_as_the_source_does():
    assert (round_size(1), round_size(512), round_size(513)) == (MIN_BLOCK, 512, 1024)
    assert segment_size(MiB) == SMALL_BUFFER and segment_size(MiB + 512) == LARGE_BUFFER
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 1) == 10 * MiB + ROUND_LARGE


def test_small_requests_share_a_2mib_segment_and_large_ones_split_only_past_1mib():
    allocator = CachingAllocator()
    handles = [allocator.malloc(100_000) for _ in range(10)]
    assert allocator.reserved == SMALL_BUFFER
    big = allocator.malloc(30 * MiB)
    allocator.free(big)
    allocator.malloc(int(29.5 * MiB))            # the rest, 0.5 MiB, is not split off a large block
    assert allocator.allocated == 30 * MiB + sum(round_size(100_000) for _ in handles)
    allocator.free(allocator.malloc(0))           # a 0-byte request still takes a 512-byte block


def test_a_freed_block_serves_only_requests_it_fits_and_only_on_its_stream():
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(100 * MiB))
    allocator.malloc(100 * MiB, stream=1)         # another stream's cache is not shared
    assert allocator.reserved == 200 * MiB
    allocator.free(allocator.malloc(60 * MiB))    # carved from the cached 100 MiB, merged back on free
    assert allocator.reserved == 200 * MiB
    allocator.malloc(150 * MiB)                   # fits no cached block: a new segment
    assert allocator.reserved == 350 * MiB and allocator.peak_reserved == 350 * MiB


def test_a_failed_cudamalloc_frees_the_cache_and_retries_then_fails():
    allocator = CachingAllocator(capacity=300 * MiB)
    allocator.free(allocator.malloc(200 * MiB))
    allocator.malloc(250 * MiB)                   # 200 cached + 250 > 300: release the cache, retry
    assert (allocator.retries, allocator.reserved) == (1, 250 * MiB)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(100 * MiB)


def test_expandable_segments_grow_one_segment_instead_of_opening_new_ones():
    plain, expandable = CachingAllocator(), CachingAllocator(expandable=True)
    for allocator in (plain, expandable):
        for size in (100, 120, 140):
            allocator.free(allocator.malloc(size * MiB))
    assert plain.reserved == 360 * MiB
    assert expandable.reserved == 140 * MiB       # the free tail grows to each longer request


def test_the_step_trace_holds_the_activation_models_bytes():
    inputs = ActivationInputs(2, 256, "none", True)
    produced, kept = layer_tensors(LLAMA, inputs)
    assert produced == kept and len(produced) > 5
    shape = StepShape(LLAMA, inputs)
    _, allocated = replay(shape, (256,))
    profile = activation_profile(LLAMA, inputs)
    expected = profile.stored + loss_bytes("plain", LLAMA.vocab, LLAMA.hidden, 2, 256, 2)
    assert allocated == pytest.approx(expected, rel=0.03)   # rounding to 512 bytes, the one gradient in flight
    checkpointed = StepShape(LLAMA, ActivationInputs(2, 256, "full", True))
    assert sum(1 for op, _, _ in step_events(checkpointed) if op == "alloc") > \
        sum(1 for op, _, _ in step_events(shape) if op == "alloc")     # the recomputation in backward


@pytest.mark.parametrize("cast", [None, 4])
def test_an_in_place_loss_and_a_cast_of_its_logits_are_traced_as_the_model_counts_them(cast):
    inputs = ActivationInputs(2, 256, "none", True)
    _, allocated = replay(StepShape(LLAMA, inputs, loss="inplace", logits_cast=cast), (256,))
    expected = activation_profile(LLAMA, inputs).stored + loss_bytes("inplace", LLAMA.vocab, LLAMA.hidden, 2, 256, 2,
                                                                     cast=cast)
    assert allocated == pytest.approx(expected, rel=0.03)   # the logsumexp rows are not traced (512-byte rounding)


def test_a_longer_batch_opens_segments_while_the_shorter_ones_stay_cached():
    shape = StepShape(LLAMA, ActivationInputs(4, 1024, "none", True))
    longest_first, _ = replay(shape, (1024, 512, 768))
    alone, _ = replay(shape, (1024,))
    rising, _ = replay(shape, (512, 768, 1024))
    assert longest_first == alone                  # shorter batches are carved from its segments
    assert rising > 1.25 * alone                   # each record left segments its successors did not fit


def test_only_the_records_of_a_run_change_what_is_reserved():
    shape = StepShape(LLAMA, ActivationInputs(2, 512, "full", True))
    rng = random.Random(3)
    sequence = [rng.randint(64, 512) for _ in range(40)]
    assert replay(shape, tuple(sequence))[0] == replay(shape, records(sequence))[0]


def test_the_replayed_excess_is_a_range_over_orders_and_expandable_segments_leave_little():
    shape = StepShape(LLAMA, ActivationInputs(1, 1024, "full", True))
    lengths = LengthDistribution.from_mean(500, cap=1024, steps=200)
    cache = shape_cache(shape, lengths)
    assert 0 < cache.low <= cache.median <= cache.high and len(cache.records) == 8
    expandable = shape_cache(shape, lengths, expandable=True)
    assert expandable.high < cache.low
    batches_at_the_cap = LengthDistribution.from_histogram({1024: 9, 100: 1}, cap=1024, micro_batch=4, steps=200)
    assert shape_cache(shape, batches_at_the_cap).high < cache.low


def test_length_distributions_from_a_mean_or_a_histogram():
    uniform = LengthDistribution.from_mean(1024, 2048)
    assert uniform.mean == pytest.approx(1024, abs=1) and uniform.assumed
    skewed = LengthDistribution.from_mean(1800, 2048)
    assert skewed.weights[-1] > skewed.weights[0]
    hist = LengthDistribution.from_histogram({"100": 1, "300": 1, 5000: 2}, cap=1000, micro_batch=2)
    assert hist.lengths == (100, 300, 1000) and not hist.assumed
    # P(batch of 2 padded to 1000) = 1 - (1/2)^2
    assert hist.reaches_cap == pytest.approx(0.75)
    dropped = LengthDistribution.from_histogram({100: 1, 300: 1, 5000: 2}, cap=1000, micro_batch=1, over_cap="drop")
    assert dropped.lengths == (100, 300) and dropped.reaches_cap == 0


@pytest.mark.parametrize("bad", [{0: 1}, {10: -1}, {"x": 1}, {5000: 1}])
def test_a_bad_histogram_is_refused(bad):
    with pytest.raises(EstimatorInputError):
        LengthDistribution.from_histogram(bad, cap=1000, micro_batch=1, over_cap="drop")
