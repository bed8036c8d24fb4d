"""A communicator's control plane: stopping for good, the rendezvous store, small objects.

:class:`Communicator` (communicator.py) moves flat buffers and counts their bytes;
this base class holds what is *not* data traffic and is never counted: tearing
the group down so peers fail at once (:meth:`ControlPlane.abort`, the reason left
in the store, abort.py), explaining a failed collective, small keys in the
rendezvous store for control agreements (step/call_agreement.py) and the
wrap-time exchange of Python objects.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ..errors import CollectiveError
from .abort import ABORT_KEY, default_store, peer_abort_reason


class ControlPlane:
    """Failure handling and control messages of one process group (see the module's docstring)."""

    rank: int
    world_size: int
    distributed: bool
    owns_group: bool
    timeout_s: float
    aborted: Optional[str]
    _group_name: str
    group: Any  # the process group, None for the default one (a property of Communicator)

    def _abort_key(self) -> str:
        """Where :meth:`abort` leaves its reason: one key per group, so a later group never reads it."""
        return f"{ABORT_KEY}/{self._group_name}"

    def explain(self, kind: str, error: Exception) -> CollectiveError:
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

    def _check_alive(self) -> None:
        if self.aborted is not None:
            raise CollectiveError(self.aborted)
