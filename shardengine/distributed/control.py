"""A communicator's control plane: stopping for good, the rendezvous store, small objects.

:class:`Communicator` (communicator.py) moves flat buffers and counts their bytes;
this base class holds what is *not* data traffic and is never counted: tearing
the group down so peers fail at once (:meth:`ControlPlane.abort`, the reason left
in the store, channel.py), explaining a failed collective, waits that notice a
stopped peer, small keys in the rendezvous store for control agreements
(step/call_agreement.py) and the wrap-time exchange of Python objects.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from .abort import default_store
from .channel import SLICE_S, ControlChannel, store_wait
from .sequence import OBJECTS, OpId, other_op

T = TypeVar("T")


_HOST_POLL_MAX_S = 2e-4  # host waits on a device collective: the longest sleep between polls


class ControlPlane:
    """Failure handling and control messages of one process group (see the module's docstring)."""

    rank: int
    world_size: int
    distributed: bool
    owns_group: bool
    timeout_s: float
    aborted: Optional[str]
    _group_name: str
    _release: Any  # weakref.finalize that queues the group for destruction (communicator.py)
    backend: Optional[str]
    group: Any  # the process group, None for the default one (a property of Communicator)
    channel: Optional[ControlChannel]  # the control word (channel.py); None without a group

    def explain(self, kind: str, error: Exception) -> CollectiveError:
        """The error of a failed collective; tells the other ranks too (see below)."""
        self._keep_group()
        peer = self.channel.reason() if self.channel is not None else None
        if peer == self.channel_reason_left():
            peer = None  # what this rank itself left earlier
        if peer and self.aborted is None:
            self.abort(peer)  # the group is dead: tear it down here too, so no work stays pending on it
        cause = (f" A peer stopped: {peer}" if peer else " A peer rank may have crashed, be stuck, "
                 "or have skipped this collective (ranks must run the same forward/backward "
                 "control flow).")
        failed = CollectiveError(
            f"rank {self.rank}/{self.world_size}: {kind} failed ({error}).{cause} Collective "
            f"timeout is {self.timeout_s:.0f}s.")
        if not peer and self.channel is not None:
            # A peer killed outright leaves no reason; the ranks that exchanged data with it fail
            # first (their sockets close): passing it on lets every stalled rank stop within a
            # slice instead of waiting for its own neighbours (see [Note: the control word]).
            self.channel.leave(str(failed))
        return failed

    def channel_reason_left(self) -> Optional[str]:
        return self.channel.reason_left if self.channel is not None else None

    def abort(self, reason: str) -> None:
        """Leave the group for good so peers waiting on this rank fail now, not at the timeout.

        Only a group this communicator created is torn down (the user's default group
        is theirs); the reason is left in the store for the peers' error messages.
        """
        if not self.distributed:
            return
        self._keep_group()
        if self.channel is not None:
            self.channel.leave(reason)  # best effort: the peers still get an error without it
        if self.group is not None and self.owns_group:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - already gone
                pass
            # torch dropped its reference; ours is weak, so the group goes now and its
            # sockets close: peers see it at once.
        self.aborted = reason

    # -- the rendezvous store (small keys for control agreements; see step/call_agreement.py)

    def store_key(self, name: str) -> str:
        """A store key private to this communicator's group."""
        return f"shardengine/{self._group_name}/{name}"

    def store_add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if absent); the new value."""
        return int(default_store().add(key, amount))

    def store_set(self, key: str, value: str) -> None:
        default_store().set(key, value)

    def store_compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if it holds ``expected`` ("": if absent); what it holds after."""
        return default_store().compare_set(key, expected, desired).decode(errors="replace")

    def store_get_many(self, keys: list[str]) -> list[str]:
        """The values of ``keys``, which must all exist (one request)."""
        return [value.decode(errors="replace") for value in default_store().multi_get(keys)]

    def store_wait(self, key: str, timeout_s: float) -> bool:
        """Block until ``key`` is set (the store answers then; no polling): False on timeout."""
        return store_wait(key, timeout_s)

    def store_get(self, key: str) -> Optional[str]:
        """The value at ``key``, or None if no rank set it (never waits)."""
        store = default_store()
        return store.get(key).decode(errors="replace") if store.check([key]) else None

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (for wrap-time checks, not the hot path)."""
        if not self.distributed:
            return [obj]
        self._check_alive()
        return self._in_order(OBJECTS, lambda: self._all_gather_object(obj))

    def _in_order(self, op: OpId, issue: Callable[[], T]) -> T:
        """``issue()``, after a round where the communicator has a sequence (stage 3: see
        [Note: checked collective order] in sequence.py)."""
        sequence = getattr(self, "sequence", None)
        if sequence is not None and sequence.active:
            return sequence.run(op, issue)
        return issue()

    def _all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj, group=self.group)
        except RuntimeError as error:
            raise self.explain("all_gather_object", error) from error
        return gathered

    def count_true(self, flag: bool) -> int:
        """How many ranks passed True: one small all-reduce (agreements off the training step)."""
        if not self.distributed:
            return int(flag)
        self._check_alive()
        return self._in_order(other_op("all_reduce", 8), lambda: self._count_true(flag))

    def _count_true(self, flag: bool) -> int:
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        count = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        try:
            self.wait_for(dist.all_reduce(count, group=self.group, async_op=True))
        except CollectiveError:
            raise
        except RuntimeError as error:
            raise self.explain("all_reduce", error) from error
        return int(self.host_copy(count).item())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` on every rank (a tree broadcast: the same cost on every rank)."""
        if not self.distributed:
            return obj
        self._check_alive()
        holder = [obj]
        try:
            source = dist.get_global_rank(self.group, src) if self.group is not None else src
            dist.broadcast_object_list(holder, src=source, group=self.group)
        except RuntimeError as error:
            raise self.explain("broadcast_object", error) from error
        return holder[0]

    def all_gather_small(self, tensor: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank's small host ``tensor``, end to end in rank order, into ``gathered`` (a control
        message: the rounds of distributed/sequence.py; not counted as traffic)."""
        if not self.distributed:
            return gathered.copy_(tensor)
        self._check_alive()
        try:
            self.wait_for(dist.all_gather_into_tensor(gathered, tensor, group=self.group, async_op=True))
        except RuntimeError as error:
            raise self.explain("a round of the checked collective order", error) from error
        return gathered

    def wait_for(self, handle: Any) -> None:
        """Wait for one backend call; on Gloo, fail as soon as a peer has stopped on purpose.

        Raises the backend's ``RuntimeError`` (``Work.wait`` turns it into a ``CollectiveError``).

        [Note: why Gloo waits look at the store]
        A rank that stops (``abort``) leaves its reason in the store, but a Gloo
        collective between two *other* ranks (a broadcast rooted at one of them,
        as our all-gathers are) does not notice: the peer that failed keeps its
        sockets open while its own queued work is pending, so the survivor would
        wait out the whole collective timeout (measured: 20 s of a 20 s timeout).
        So a Gloo wait is cut into ``wait(timeout=slice)`` slices (0.5 s, longer
        beyond 2,048 ranks: ``channel.poll_interval_s``), and
        between slices the control word is read (channel.py: one request; the
        same read finds an announced call this rank skipped). A slice ends the
        moment the work completes, so a healthy step pays nothing. (A slice that
        times out leaves the work pending, unlike a failed collective, which
        completes with its error: ``is_completed()`` tells them apart. Gloo's
        native reduce-scatter ignores the slice and waits whole.) NCCL waits are
        left to NCCL: ``wait()`` there only orders the stream and must not block
        the host; :meth:`host_copy` is where the host waits for a device collective.
        """
        if self.backend != "gloo" or self.channel is None:
            handle.wait()
            return
        slice_ = timedelta(seconds=self.channel.interval_s)
        while True:
            try:
                handle.wait(timeout=slice_)
                return
            except RuntimeError:
                if handle.is_completed():
                    raise  # the collective itself failed
            self._raise_if_peer_stopped()

    def wait_until(self, ready: Callable[[], bool]) -> None:
        """Block the host until ``ready()``, reading the control word after every slice stalled."""
        interval = self.channel.interval_s if self.channel is not None else SLICE_S
        pause, next_check = 1e-5, time.monotonic() + interval
        while not ready():
            time.sleep(pause)
            pause = min(2 * pause, _HOST_POLL_MAX_S)
            if time.monotonic() >= next_check:
                self._raise_if_peer_stopped()
                next_check = time.monotonic() + interval

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the result of a collective just waited for) on the host.

        On a device the copy would block until the collective completes, with no way to
        notice a stopped peer; so the host polls an event instead (:meth:`wait_until`).
        """
        if tensor.is_cuda and self.distributed:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(tensor.device))
            try:
                self.wait_until(done.query)
            except CollectiveError:
                raise
            except RuntimeError as error:
                raise self.explain("all_reduce", error) from error
        return tensor.cpu()

    def _raise_if_peer_stopped(self) -> None:
        """Between slices of a stalled wait (see the Note above)."""
        if self.channel is None:
            return
        peer = self.channel.check_stalled()  # may raise: a skipped announced call (call_agreement.py)
        if peer and peer != self.aborted:
            raise RuntimeError("a peer stopped while this rank waited")  # Work.wait explains it

    def _keep_group(self) -> None:
        """After a failure, work may be stuck on the group until its timeout, and destroying it
        would wait that long: it is left to torch (destroy_process_group at exit) instead."""
        if self._release is not None:
            self._release.detach()

    def _check_alive(self) -> None:
        if self.aborted is not None:
            raise CollectiveError(self.aborted)
