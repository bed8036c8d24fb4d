"""The allocator tracker on cases whose answer is known: allocations, frees, resize_, a model's Adam state."""
import threading

import pytest
import torch

from shardengine.testing.allocator_tracker import AllocatorTracker


def test_alloc_free_resize_peaks_are_exact():
    with AllocatorTracker() as tracker:
        with tracker.phase("a"):
            x = torch.empty(1000, dtype=torch.uint8)
            y = torch.empty(500, dtype=torch.uint8)
            del x
        with tracker.phase("b"):
            y.untyped_storage().resize_(0)
            y.untyped_storage().resize_(3000)
    assert tracker.peak_in("a") == 1500
    assert tracker.live_at_start_of("b") == 500
    assert tracker.peak_in("b") == 3000
    assert tracker.live_at_end() == 3000


def test_model_states_between_steps_match_their_bytes():
    with AllocatorTracker() as tracker:
        model = torch.nn.Linear(64, 32)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with tracker.phase("between"):
            pass
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    expected = sum(p.nbytes for p in model.parameters()) + sum(t.nbytes for t in states)
    assert tracker.live_at_start_of("between") == expected


def test_free_of_a_block_allocated_before_tracking_is_not_counted():
    with AllocatorTracker():  # an earlier profiled span: the reporter knows the block from here
        early = torch.empty(4096, dtype=torch.uint8)
    with AllocatorTracker() as tracker:
        del early  # reported as -4096, but its +4096 was never counted here
        with tracker.phase("after"):
            late = torch.empty(100, dtype=torch.uint8)
    assert tracker.live_at_start_of("after") == 0
    assert tracker.live_at_end() == late.nbytes


def test_free_on_an_unfollowed_thread_is_inferred_when_the_address_is_reused():
    """A plain thread's free is not reported; the allocator handing the same address out again
    proves it happened. 64 MiB is above glibc's largest mmap threshold, so the block is
    unmapped at its free and the same-sized mapping right after gets the same address."""
    size = 64 * 2**20
    box = [None]
    with AllocatorTracker() as tracker:
        box[0] = torch.empty(size, dtype=torch.uint8)
        address = box[0].data_ptr()
        releaser = threading.Thread(target=box.clear)
        releaser.start()
        releaser.join()
        with tracker.phase("again"):
            again = torch.empty(size, dtype=torch.uint8)
    if again.data_ptr() != address:
        pytest.skip("the allocator gave the second block another address: nothing proves the free")
    assert tracker.inferred_frees == 1
    assert tracker.peak_in("again") == size  # the first block counted freed: one block, not two
    assert tracker.live_at_end() == size


def test_bytes_since_a_point_ignore_an_older_block_whose_free_is_inferred_later():
    """A block of before ``base`` freed unseen and inferred at its address's reuse after ``base``:
    what was allocated since ``base`` is exactly the new blocks, where a difference of two totals
    would subtract the old block from them."""
    size = 64 * 2**20
    box = []
    with AllocatorTracker() as tracker:
        box.append(torch.empty(size, dtype=torch.uint8))  # freed unseen below
        address = box[0].data_ptr()
        releaser = threading.Thread(target=box.clear)
        releaser.start()
        releaser.join()
        with tracker.phase("base"):
            pass
        reused = torch.empty(size, dtype=torch.uint8)
        small = torch.empty(1000, dtype=torch.uint8)
        with tracker.phase("end"):
            pass
    if reused.data_ptr() != address:
        pytest.skip("the allocator gave the second block another address: nothing proves the free")
    assert tracker.live_at_start_of("end", since="base") == size + small.nbytes
    assert tracker.peak_in("end", since="base") == size + small.nbytes
    assert tracker.live_at_start_of("end") - tracker.live_at_start_of("base") == small.nbytes  # the old way
