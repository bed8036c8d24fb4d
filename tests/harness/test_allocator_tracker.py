"""The allocator tracker on cases whose answer is known: allocations, frees, resize_, a model's Adam state."""
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
