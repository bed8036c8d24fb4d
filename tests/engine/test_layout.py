"""Properties of the pure flat-buffer layout math (shardengine.flat.layout); no process group."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from shardengine.flat.layout import FlatLayout, padded_numel, split_into_buckets

world_sizes = st.integers(min_value=1, max_value=16)
# Shapes include zero-sized dims, scalars and odd sizes.
shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=3).map(tuple)
shape_lists = st.lists(shapes, min_size=0, max_size=12)


@given(numel=st.integers(min_value=0, max_value=10**6), world=world_sizes)
def test_padded_numel_is_smallest_multiple_of_world_at_least_numel(numel: int, world: int) -> None:
    padded = padded_numel(numel, world)
    assert padded % world == 0
    assert padded >= numel
    assert padded - world < numel  # the next smaller multiple would not fit
    assert padded == -(-numel // world) * world


@given(shape_list=shape_lists, world=world_sizes)
def test_layout_numel_padding_and_slots(shape_list: list[tuple[int, ...]], world: int) -> None:
    layout = FlatLayout.build(shape_list, world)
    numels = [math.prod(shape) for shape in shape_list]
    assert layout.numel == sum(numels)
    assert layout.padded_numel == padded_numel(layout.numel, world)
    assert layout.padding == layout.padded_numel - layout.numel
    assert 0 <= layout.padding < world
    assert layout.shard_numel * world == layout.padded_numel
    offset = 0
    for slot, shape, numel in zip(layout.slots, shape_list, numels):
        assert (slot.shape, slot.offset, slot.numel, slot.end) == (tuple(shape), offset, numel, offset + numel)
        offset += numel


@given(shape_list=shape_lists, world=world_sizes)
def test_shards_are_equal_contiguous_disjoint_and_cover_the_padded_buffer(
        shape_list: list[tuple[int, ...]], world: int) -> None:
    layout = FlatLayout.build(shape_list, world)
    ranges = [layout.owned_range(rank) for rank in range(world)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == layout.padded_numel
    for (start, end), (next_start, _) in zip(ranges, ranges[1:]):
        assert end == next_start  # contiguous and disjoint
    assert {end - start for start, end in ranges} == {layout.shard_numel}


@given(shape_list=shape_lists, world=world_sizes)
def test_fragments_cover_every_param_element_once_and_never_padding(
        shape_list: list[tuple[int, ...]], world: int) -> None:
    layout = FlatLayout.build(shape_list, world)
    covered: list[int] = []  # flat-buffer positions, from every rank's fragments
    for rank in range(world):
        start, end = layout.owned_range(rank)
        previous_shard_end = 0
        for fragment in layout.fragments(rank):
            slot = layout.slots[fragment.slot]
            assert 0 <= fragment.param_start < fragment.param_end <= slot.numel
            assert fragment.numel == fragment.param_end - fragment.param_start > 0
            # Shard offset agrees with the layout: flat position = slot offset + param index.
            flat_start = slot.offset + fragment.param_start
            assert fragment.shard_start == flat_start - start
            assert fragment.shard_start >= previous_shard_end  # in buffer order, no overlap
            assert fragment.shard_start + fragment.numel <= end - start
            previous_shard_end = fragment.shard_start + fragment.numel
            covered.extend(range(flat_start, flat_start + fragment.numel))
    assert sorted(covered) == list(range(layout.numel))  # each element once, no padding


@given(shape_list=shape_lists, world=world_sizes)
def test_zero_sized_params_have_no_fragments(shape_list: list[tuple[int, ...]], world: int) -> None:
    layout = FlatLayout.build(shape_list, world)
    empty = {index for index, slot in enumerate(layout.slots) if slot.numel == 0}
    for rank in range(world):
        assert not empty & {fragment.slot for fragment in layout.fragments(rank)}


@given(numels=st.lists(st.integers(min_value=0, max_value=50), max_size=30),
       cap=st.integers(min_value=1, max_value=60))
def test_split_into_buckets_covers_in_order_within_cap(numels: list[int], cap: int) -> None:
    buckets = split_into_buckets(numels, cap)
    assert [index for bucket in buckets for index in bucket] == list(range(len(numels)))
    for bucket in buckets:
        assert bucket, "no empty buckets"
        total = sum(numels[index] for index in bucket)
        assert total <= cap or len(bucket) == 1, f"bucket {bucket} holds {total} > {cap}"


@pytest.mark.parametrize("world", [0, -1, -7])
def test_world_size_below_one_is_refused(world: int) -> None:
    with pytest.raises(ValueError, match="world_size"):
        padded_numel(10, world)
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.build([(3,)], world)


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_rank_outside_world_is_refused(rank: int) -> None:
    layout = FlatLayout.build([(3, 3)], 4)
    with pytest.raises(ValueError, match="rank"):
        layout.owned_range(rank)
    with pytest.raises(ValueError, match="rank"):
        layout.fragments(rank)


@pytest.mark.parametrize("cap", [0, -5])
def test_bucket_cap_below_one_is_refused(cap: int) -> None:
    with pytest.raises(ValueError, match="bucket"):
        split_into_buckets([1, 2], cap)


def test_empty_layout() -> None:
    layout = FlatLayout.build([], 3)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (0, 0, 0)
    assert all(layout.fragments(rank) == [] for rank in range(3))
