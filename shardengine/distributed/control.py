"""A communicator's control plane: stopping for good, the rendezvous store, small objects.

:class:`Communicator` (communicator.py) moves flat buffers and counts their bytes;
this base class holds what is *not* data traffic and is never counted: tearing
the group down so peers fail at once (:meth:`ControlPlane.abort`, the reason left
in the store, abort.py), explaining a failed collective, small keys in the
rendezvous store for control agreements (step/call_agreement.py) and the
wrap-time exchange of Python objects.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..errors import CollectiveError
from .abort import ABORT_KEY, default_store, peer_abort_reason


# A Gloo wait reads the store for a peer's abort reason after every slice this long (see wait_for).
_ABORT_CHECK = timedelta(seconds=0.5)


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

    def _abort_key(self) -> str:
        """Where :meth:`abort` leaves its reason: one key per group, so a later group never reads it."""
        return f"{ABORT_KEY}/{self._group_name}"

    def explain(self, kind: str, error: Exception) -> CollectiveError:
        self._keep_group()
        peer = peer_abort_reason(self._abort_key())
        if peer and self.aborted is None:
            self.abort(peer)  # the group is dead: tear it down here too, so no work stays pending on it
        cause = (f" A peer stopped: {peer}" if peer else " A peer rank may have crashed, be stuck, "
                 "or have skipped this collective (ranks must run the same forward/backward "
                 "control flow).")
        return CollectiveError(
            f"rank {self.rank}/{self.world_size}: {kind} failed ({error}).{cause} Collective "
            f"timeout is {self.timeout_s:.0f}s.")

    def abort(self, reason: str) -> None:
        """Leave the group for good so peers waiting on this rank fail now, not at the timeout.

        Only a group this communicator created is torn down (the user's default group
        is theirs); the reason is left in the store for the peers' error messages.
        """
        if not self.distributed:
            return
        self._keep_group()
        try:
            default_store().set(self._abort_key(), reason)
        except Exception:  # noqa: BLE001 - best effort: the peers still get an error
            pass
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

    def store_get(self, key: str) -> Optional[str]:
        """The value at ``key``, or None if no rank set it (never waits)."""
        store = default_store()
        return store.get(key).decode(errors="replace") if store.check([key]) else None

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (for wrap-time checks, not the hot path)."""
        if not self.distributed:
            return [obj]
        self._check_alive()
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj, group=self.group)
        except RuntimeError as error:
            raise self.explain("all_gather_object", error) from error
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
        So a Gloo wait is cut into ``wait(timeout=_ABORT_CHECK)`` slices, and
        between slices the store's abort key is read. A slice ends the moment the
        work completes, so a healthy step pays nothing. (A slice that times out
        leaves the work pending, unlike a failed collective, which completes with
        its error: ``is_completed()`` tells them apart. Gloo's native
        reduce-scatter ignores the slice and waits whole.) NCCL waits are left to
        NCCL: ``wait()`` there only orders the stream and must not block the host.
        """
        if self.backend != "gloo":
            handle.wait()
            return
        while True:
            try:
                handle.wait(timeout=_ABORT_CHECK)
                return
            except RuntimeError:
                if handle.is_completed():
                    raise  # the collective itself failed
            peer = peer_abort_reason(self._abort_key())
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
