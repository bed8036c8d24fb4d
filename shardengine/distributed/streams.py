"""Side streams and events on CUDA: which work runs where, what stays alive, where the host waits.

[Note: CUDA streams]
On a CPU every collective and copy runs in program order, so the engine needs
nothing here. On CUDA the collectives (NCCL kernels) and the copies around them
only overlap compute if they are queued on streams of their own. The plan,
following FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``,
``FSDPCommContext``; ``_fsdp_collectives.py``):

* **gather stream** (high priority, as FSDP2's ``all_gather_stream``): a stage-3
  unit's all-gather and the copy-out that re-points its parameters. It first
  waits for the compute stream (the shard it reads was written there by the
  optimizer step). The compute stream waits for the gather's *event* just
  before the unit's forward (or backward) uses it, not sooner, so the next
  unit's gather (prefetch) runs under the current unit's compute.
* **reduce stream** (high priority, FSDP2's ``reduce_scatter_stream``): a
  bucket's copy-in (the gradient cast into the flat reduce buffer), its
  reduce-scatter (or all-reduce) and the write of the reduced shard. It waits
  for the compute stream at the moment the bucket is ready (the backward kernels
  that produced the gradients were queued there).
* **host-copy stream**: offload's device-to-host copies of reduced gradient
  shards into pinned memory, so a copy does not wait behind the next
  reduce-scatter. Host-to-device copies of the fp32 master into the compute
  copy of the parameters run on the compute stream, ``non_blocking`` when the
  master is pinned (flat/bucket.py, ``copy_master_to_params``): the next read of
  the parameters is queued behind them on that same stream.

Memory freed on one stream while another still uses it: the caching allocator
reuses a block as soon as its Python reference is gone, for the stream it was
*allocated* on. FSDP2 keeps such buffers referenced until an event recorded
after their last use has been waited for (its ``reduce_scatter_states`` hold
the reduce-scatter input until the compute stream waits on its event, bounded
by ``max_input_buffers``), rather than ``Tensor.record_stream``, which delays
the reuse to an unknown later point and so raises the peak unpredictably.
:class:`InFlight` is that hold: a buffer stays referenced with the event of its
last use on the other stream, and is dropped once the event has completed
(``release_finished``) or after the consuming stream has been told to wait for
it (``drain``).

Where the host waits (``Event.synchronize``), and only there: before the CPU
optimizer step reads offloaded gradients (the device-to-host copy's event, as
FSDP2's ``grad_offload_event``); before the host writes a pinned master that an
asynchronous copy may still read (``FlatBucket.wait_for_master_copy``: the
optimizer step, through ``master_grad``, and loading a state dict); at the end of backward the *compute stream*
(not the host) waits for the last reduce event, so the optimizer step on the
device is ordered after every reduction; ``memory_report()`` and checkpointing
read values and so wait as torch's own ``.cpu()`` does.

The stage engine issues its collectives through ``Communicator`` today without
side streams (everything on the compute stream: correct, no overlap). Wiring
this in is the stages' job: the gather path (stage 3) and the reducer's
launch/finish points are where :meth:`CommStreams.run_on`, :meth:`record` and
:class:`InFlight` go. Everything here is a no-op off CUDA, so the same code
runs in the CPU tests.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Iterator, Optional, Protocol

import torch

# FSDP2 runs its collective streams at high priority so that their small copies
# in and out are not queued behind long compute kernels.
HIGH_PRIORITY = -1


class EventLike(Protocol):
    def query(self) -> bool: ...


class CommStreams:
    """The engine's side streams on one CUDA device; on any other device every method is a no-op.

    >>> streams = CommStreams(torch.device("cpu"))
    >>> with streams.run_on(streams.gather):
    ...     y = torch.ones(2) * 2
    >>> streams.record(streams.gather) is None, streams.enabled
    (True, False)
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda" and torch.cuda.is_available()
        make = (lambda priority=0: torch.cuda.Stream(device, priority=priority)) if self.enabled \
            else (lambda priority=0: None)
        self.gather = make(HIGH_PRIORITY)
        self.reduce = make(HIGH_PRIORITY)
        self.host_copy = make()

    def compute(self) -> Optional[Any]:
        """The stream the user's forward and backward run on (None off CUDA)."""
        return torch.cuda.current_stream(self.device) if self.enabled else None

    @contextlib.contextmanager
    def run_on(self, stream: Optional[Any]) -> Iterator[None]:
        """Queue the work issued inside on ``stream``, after what the compute stream holds so far."""
        if stream is None:
            yield
            return
        stream.wait_stream(self.compute())
        with torch.cuda.stream(stream):
            yield

    def record(self, stream: Optional[Any] = None) -> Optional[Any]:
        """An event marking the work queued on ``stream`` (default: compute) so far; None off CUDA."""
        if not self.enabled:
            return None
        return (stream or self.compute()).record_event()

    def wait(self, event: Optional[Any], stream: Optional[Any] = None) -> None:
        """``stream`` (default: compute) waits for ``event`` on the device; the host does not block."""
        if event is not None:
            (stream or self.compute()).wait_event(event)


def host_wait(event: Optional[Any]) -> None:
    """The host blocks until ``event`` has completed (a CPU reader of an asynchronous copy)."""
    if event is not None:
        event.synchronize()


def copy_between(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``, asynchronous exactly when one side is pinned host memory.

    A pinned host buffer is the only kind the GPU's copy engine reads or writes
    without a staging copy; from pageable memory ``non_blocking`` would be
    synchronous anyway. A CPU reader of a device-to-host result must wait for an
    event first (:func:`host_wait`).
    """
    pinned = (source.device.type == "cpu" and source.is_pinned()) or \
             (target.device.type == "cpu" and target.is_pinned())
    target.copy_(source, non_blocking=pinned and source.device != target.device)


class InFlight:
    """Buffers another stream still uses, each held with the event of that use (see the Note).

    >>> class Done:
    ...     def query(self): return True
    >>> held = InFlight()
    >>> held.hold(Done(), torch.zeros(4))
    >>> len(held), held.release_finished(), len(held)
    (1, 1, 0)
    """

    def __init__(self) -> None:
        self._pending: deque[tuple[Optional[EventLike], tuple[torch.Tensor, ...]]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def hold(self, event: Optional[EventLike], *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` referenced until ``event`` (None: already done, as on a CPU)."""
        self._pending.append((event, tensors))

    def release_finished(self) -> int:
        """Drop the oldest holds whose events have completed, in order; how many were dropped."""
        released = 0
        while self._pending and (self._pending[0][0] is None or self._pending[0][0].query()):
            self._pending.popleft()
            released += 1
        return released

    def drain(self, streams: CommStreams, stream: Optional[Any] = None) -> int:
        """``stream`` (default: compute) waits for every held event, then the holds are dropped:
        reuse of the memory from that stream is ordered after the other stream's use."""
        released = len(self._pending)
        while self._pending:
            event, _ = self._pending.popleft()
            streams.wait(event, stream)
        return released
