"""One engine's control word in the rendezvous store: how its ranks hear of events off the data path.

[Note: the control word]
Two things must reach ranks that are blocked in a collective: a peer that
stopped on purpose (``abort``: the collectives it left will never complete),
and a peer that announced a collective call this rank skipped
(step/call_agreement.py). Neither may cost anything while training runs, and
at thousands of ranks neither may cost a rank more store traffic than at two.

So each engine's group has one integer key in the rendezvous store, its
*control word*. Every announcement of a collective call adds 1 (after k calls
on N ranks in step it is k·N); an abort adds :data:`ABORTED` and leaves its
reason under a second key. A rank reads the word only while it is stalled:
a Gloo wait that has not completed after a slice, or a host wait on a device
collective (``Communicator.host_copy``). One ``add(word, 0)`` per slice tells
it whether anything happened; only then does it read more. A healthy step
that does not stall sends nothing.

The slice (:func:`poll_interval_s`) is 0.5 s up to 2,048 ranks and N / 4,096 s
beyond: while every rank is stalled (one slow or dead peer stalls them all,
at the same instant) the store then serves at most 4,096 reads a second
whatever N is, and a rank sends fewer, not more, as N grows. One TCPStore on
two shared cores answered 6,000-12,000 requests a second at 1,024-8,192
simulated ranks (``benchmarks/bench_control_plane.py``); at 16,384 a second
(8,192 ranks every 0.5 s) the last answers came 2 s late.

Time to notice: a rank blocked in a Gloo collective learns that a peer stopped
within one slice plus one store round trip (0.5 s up to 2,048 ranks, 2 s at
8,192). A peer killed outright leaves no reason, but the Gloo peers that
exchanged data with it fail at once (their sockets close) and leave one
(``ControlPlane.explain``), which the rest read at their next slice.

>>> channel = ControlChannel("7")
>>> channel.key("word"), channel.reason_key
('shardengine/7/word', 'shardengine/abort_reason/7')
>>> ABORTED > 2**32
True
>>> poll_interval_s(8), poll_interval_s(2048), poll_interval_s(8192)
(0.5, 0.5, 2.0)
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from .abort import ABORT_KEY, default_store, peer_abort_reason

ABORTED = 1 << 40  # what an abort adds to the word; each announcement adds 1 (at most 2**40 of them)
SLICE_S = 0.5            # the longest a stalled rank goes without reading the word, up to...
STALLED_READS_PER_S = 4096  # ...the world size at which every stalled rank reading it would exceed this


def poll_interval_s(world_size: int) -> float:
    """How long a stalled wait goes between reads of the word (see the Note)."""
    return max(SLICE_S, world_size / STALLED_READS_PER_S)


class ControlChannel:
    """The control word and abort reason of one engine's groups (see the Note).

    Hooks are held weakly (bound methods of the engine's collaborators): the channel
    lives as long as the communicators, and must not keep an engine alive.
    """

    def __init__(self, name: str, world_size: int = 1) -> None:
        self.name = name
        self.interval_s = poll_interval_s(world_size)  # between reads of the word while stalled
        self._stall_checks: list[weakref.WeakMethod] = []
        self._abort_hooks: list[weakref.WeakMethod] = []
        self.reason_left: Optional[str] = None  # what this rank left (abort or a relayed failure)

    def key(self, what: str) -> str:
        """A store key private to this channel."""
        return f"shardengine/{self.name}/{what}"

    @property
    def reason_key(self) -> str:
        """Where a rank that stops leaves its reason: one key per group, so a later group never reads it."""
        return f"{ABORT_KEY}/{self.name}"

    def on_stall(self, check: Callable[[int], None]) -> None:
        """Call ``check(word)`` whenever a stalled wait reads a word without an abort in it."""
        self._stall_checks.append(weakref.WeakMethod(check))

    def on_abort(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once this rank stops (to wake ranks waiting for it off the data path)."""
        self._abort_hooks.append(weakref.WeakMethod(hook))

    # -- the word

    def word(self) -> int:
        """The control word (one store request)."""
        return int(default_store().add(self.key("word"), 0))

    def bump(self) -> int:
        """Add one announcement to the word; its new value."""
        return int(default_store().add(self.key("word"), 1))

    def reason(self) -> Optional[str]:
        """What a rank that stopped left, or None."""
        return peer_abort_reason(self.reason_key)

    def leave(self, reason: str) -> None:
        """This rank stops: leave ``reason`` (the first one left stays) and mark the word, once."""
        if self.reason_left is not None:
            return
        self.reason_left = reason
        try:
            store = default_store()
            store.compare_set(self.reason_key, "", reason)
            store.add(self.key("word"), ABORTED)
        except Exception:  # noqa: BLE001 - best effort: the store may be gone with rank 0's host
            return
        for hook in [ref() for ref in self._abort_hooks]:
            if hook is not None:
                try:
                    hook()
                except Exception:  # noqa: BLE001 - best effort, as above
                    pass

    def check_stalled(self) -> Optional[str]:
        """Between slices of a stalled wait: a peer's reason for stopping, if one stopped.

        Otherwise runs the stall checks, which may raise (a skipped announced call).
        One store request when nothing happened.
        """
        try:
            word = self.word()
        except Exception:  # noqa: BLE001 - no store (gone with rank 0's host): nothing to read
            return None
        if word >= ABORTED:
            reason = self.reason()
            return reason if reason != self.reason_left else None
        for check in [ref() for ref in self._stall_checks]:
            if check is not None:
                check(word)
        return None


def store_wait(key: str, timeout_s: float) -> bool:
    """Block until ``key`` exists in the store (the server answers when it is set): False on timeout."""
    try:
        default_store().wait([key], timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        return False
    return True
