"""Collectives outside the training step, announced so that a rank skipping one is caught at once.

[Note: announcing calls like model.state_dict()]
``if rank == 0: torch.save(model.state_dict(), path)`` is the DDP idiom, but at
stage 3 (and with fp32 masters at stages 1-2) ``state_dict()`` gathers slices
from every rank. Run on rank 0 alone, its gathers would pair with the other
ranks' next forward or backward collectives: wrong values, then a hang until
the collective timeout with a message about control flow, naming nothing.

So each such call (``model.state_dict()``, ``full_state_dict()``,
``summon_full_params()``, ``full_optimizer_state_dict()``, ``save_checkpoint``,
``load_checkpoint``), when it is collective, first *announces* itself in the
rendezvous store and waits, before its first collective, until every rank has
announced the same call. Nothing is mispaired: an announcing rank issues no
collective before then.

A rank that skipped the call does not announce it; it goes on to its next
communicating engine call (a stage-3 forward, a backward, a step or clip), whose
collectives cannot complete, because the announcing ranks issue none. Every
rank counts those calls locally (its *position*, no store traffic: a training
step sends nothing to the store), and the announcement records the announcer's
position. The skipping rank's wait stalls; between slices of it the rank reads
the group's control word (distributed/channel.py, one request per 0.5 s, only
while stalled), sees an announcement it has not made, and if its own position
has reached the announced one (it began another call where the announced one
belonged, rather than still finishing the one before) it stops the engine,
naming the call and the ranks that made it. The abort wakes the announcing
ranks, whose errors carry the same message (see ``comm.abort``). On NCCL the
host notices at the step's agreement (``Communicator.host_copy``).

Per rank and announced call: five store requests (six for the last to arrive),
whatever the world size; the announcing ranks wait in the store's own ``wait``
(the server answers when the last rank arrives), not by polling.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from ..distributed.channel import ABORTED
from ..distributed.communicator import Communicator

HOW_TO = {
    "model.state_dict()": "call it on every rank, or use model.full_state_dict(rank0_only=True) on "
                          "every rank to get the tensors on rank 0 only",
    "model.full_state_dict()": "call it on every rank (rank0_only=True returns {} on the others)",
    "model.summon_full_params()": "enter it on every rank",
    "model.full_optimizer_state_dict()": "call it on every rank (rank0_only=True returns {} on the "
                                         "others)",
    "se.save_checkpoint()": "call it on every rank: each writes its own shard, rank 0 publishes",
    "se.load_checkpoint()": "call it on every rank: each reads the ranges it holds",
}
# The call a rank whose training forward raised makes at stages 0-2: the others must have
# raised too (stages/failure.py: [Note: an exception inside forward]).
RAISED_FORWARD = "a training forward pass that raised"
_DONE, _STOPPED = "done", "stopped"  # what the done key of a call holds


class CallAgreement:
    """One engine's announced calls and its position in the sequence (see the Note)."""

    def __init__(self, comm: Communicator, stage: int) -> None:
        self.comm, self.stage = comm, stage
        self.made = 0       # calls this rank announced
        self.position = 0   # communicating engine calls this rank began, announcements included
        self.began = "its next forward, backward or optimizer step"  # the last one begun (for messages)
        self._owner: Optional[weakref.ref] = None
        self.active = comm.distributed and comm.world_size > 1 and _store_works(self)
        if self.active and comm.channel is not None:
            comm.channel.on_stall(self._on_stall)
            comm.channel.on_abort(self._wake_waiters)

    def check(self, engine, what: str) -> None:
        """A communicating engine call (``what``) begins: count it, here only (no store request)."""
        self.position += 1
        self.began = what
        if self._owner is None:
            self._owner = weakref.ref(engine)

    def announce(self, engine, name: str) -> None:
        """Before the collectives of call ``name``: wait until every rank announced it too."""
        if not self.active:
            return
        self.made += 1
        self.position += 1
        self._owner = weakref.ref(engine)
        number, comm = self.made, self.comm
        comm.store_set(self._rank_key(comm.rank), f"{number}|{name}")  # who made which call (messages)
        first = comm.store_compare_set(self._call_key(number, "name"), "", f"{self.position}|{name}")
        called = first.split("|", 1)[-1]
        if called != name:
            engine.failure.fail(f"the ranks entered different collective calls (rank {comm.rank}: {name}, "
                                f"another rank: {called}); every rank must make the same calls in the "
                                "same order")
        word = comm.channel.bump()
        if word >= ABORTED:
            self._peer_stopped(engine, name)
        if word == number * comm.world_size:  # the last rank to arrive
            comm.store_set(self._call_key(number, _DONE), _DONE)
        if not comm.store_wait(self._call_key(number, _DONE), comm.timeout_s):
            engine.failure.fail(self._skipped(name, number, f"did not call it within the collective timeout "
                                                        f"({comm.timeout_s:.0f}s)"))
        if comm.store_get_many([self._call_key(number, _DONE)]) != [_DONE]:
            self._peer_stopped(engine, name)

    # -- on a stalled rank (between slices of a wait, see distributed/channel.py)

    def _on_stall(self, word: int) -> None:
        """Stop if another rank announced a call this rank went past without making it."""
        engine = self._owner() if self._owner is not None else None
        if engine is None or word <= self.made * self.comm.world_size:
            return  # no announcement beyond this rank's own
        number = self.made + 1
        announced = self.comm.store_get(self._call_key(number, "name"))
        if announced is None:
            return
        position, name = announced.split("|", 1)
        if self.position < int(position):
            return  # still in the call before it: the announced call may come next here too
        if self.comm.store_add(self._call_key(number, "detected"), 1) > 1:
            return  # another skipping rank says it; this one hears of it at its next slice
        engine.failure.fail(self._skipped(name, number, f"went on to {self.began} instead"))

    def _wake_waiters(self) -> None:
        """This rank stopped: ranks waiting in an announcement it was part of, or skipped, stop too."""
        if self.active:
            for number in {self.made, self.made + 1} - {0}:
                self.comm.store_compare_set(self._call_key(number, _DONE), "", _STOPPED)

    # -- messages

    def _peer_stopped(self, engine, name: str) -> None:
        reason = self.comm.channel.reason() or "no reason left in the store"
        engine.failure.fail(f"a peer stopped while the ranks agreed on {name}: {reason}")

    def _skipped(self, name: str, number: int, what_others_did: str) -> str:
        """Which ranks made call ``number`` (one store request: every rank's last announced call)."""
        world = range(self.comm.world_size)
        made = self.comm.store_get_many([self._rank_key(rank) for rank in world])
        callers = [rank for rank, value in zip(world, made) if value == f"{number}|{name}"]
        others = [rank for rank in world if rank not in callers]
        if name == RAISED_FORWARD:
            return (f"a training forward pass raised on {ranks_named(callers)} only; {ranks_named(others)} "
                    f"{what_others_did} (a backward that the others will not run)")
        advice = HOW_TO.get(name, "make it on every rank")
        return (f"{name} was called on rank(s) {_ranks(callers)} but not on rank(s) {_ranks(others)}, which "
                f"{what_others_did}. {name} is collective here (stage {self.stage}: it gathers "
                f"every rank's slices); {advice}")

    def _rank_key(self, rank: int) -> str:
        return self.comm.channel.key(f"calls/rank{rank}")

    def _call_key(self, number: int, what: str) -> str:
        return self.comm.channel.key(f"calls/{number}/{what}")


def ranks_named(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``.

    >>> ranks_named([1]), ranks_named([0, 2])
    ('rank 1', 'ranks 0, 2')
    """
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _ranks(ranks: list[int]) -> str:
    """``[0, 2]``; a long list shortened, with its length."""
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:4]))}, ..., {', '.join(map(str, ranks[-2:]))}] ({len(ranks)} ranks)"


def _store_works(agreement: Any) -> bool:
    """Record that this rank has made no announced call yet; False where the group's store cannot
    (a fake process group simulating N ranks in one process, memory_estimator.measure.validate,
    has a store without keys, and nothing to agree with)."""
    comm = agreement.comm
    try:
        comm.store_set(agreement._rank_key(comm.rank), "0|")
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True
