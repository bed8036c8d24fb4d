"""The stream and event helpers (shardengine/distributed/streams.py): no-ops off CUDA, and the
hold-until-event rule that keeps a buffer alive for another stream (FSDP2's, not record_stream)."""
from __future__ import annotations

import torch

from shardengine.distributed.streams import CommStreams, InFlight, copy_between, host_wait


class FakeEvent:
    """An event whose completion the test decides; records who waited for it."""

    def __init__(self, done: bool = False):
        self.done, self.waited_by = done, []

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def test_off_cuda_every_helper_is_a_no_op_and_the_values_are_right() -> None:
    streams = CommStreams(torch.device("cpu"))
    assert not streams.enabled and streams.gather is streams.reduce is streams.host_copy is None
    source = torch.arange(6.0)
    with streams.run_on(streams.gather):
        gathered = source * 2
    event = streams.record(streams.gather)
    assert event is None
    streams.wait(event)
    host_wait(event)
    assert torch.equal(gathered, torch.arange(6.0) * 2)


def test_a_held_buffer_is_released_only_after_its_event_and_in_order() -> None:
    first, second = FakeEvent(), FakeEvent(done=True)
    held = InFlight()
    a, b = torch.zeros(3), torch.ones(3)
    held.hold(first, a)
    held.hold(second, b)
    assert held.release_finished() == 0 and len(held) == 2   # the oldest is still in use
    first.done = True
    assert held.release_finished() == 2 and len(held) == 0
    held.hold(None, a)     # no event (a CPU): done at once
    assert held.release_finished() == 1


def test_drain_makes_the_consuming_stream_wait_for_every_hold() -> None:
    streams, consumer = CommStreams(torch.device("cpu")), FakeStream()
    pending = [FakeEvent(), FakeEvent()]
    held = InFlight()
    for event in pending:
        held.hold(event, torch.zeros(1))
    assert held.drain(streams, consumer) == 2 and len(held) == 0
    assert consumer.waited == pending


def test_copies_between_host_and_host_are_plain_and_exact() -> None:
    source, target = torch.randn(16), torch.empty(16)
    copy_between(target, source)
    assert torch.equal(target, source)
