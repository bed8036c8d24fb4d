"""Collectives outside the training step, announced so that a rank skipping one is caught at once.

[Note: announcing calls like model.state_dict()]
``if rank == 0: torch.save(model.state_dict(), path)`` is the DDP idiom, but at
stage 3 (and with fp32 masters at stages 1-2) ``state_dict()`` gathers slices
from every rank. Run on rank 0 alone, its gathers would pair with the other
ranks' next forward or backward collectives: wrong values, then a hang until
the collective timeout with a message about control flow, naming nothing.

So each such call (``model.state_dict()``, ``full_state_dict()``,
``summon_full_params()``, ``full_optimizer_state_dict()``), when it is
collective, first announces itself in the rendezvous store, and every rank
counts its *communicating engine calls* there: a stage-3 forward, a backward,
a step or clip (the gradient sync), and these announcements. Ranks in step
make the same sequence of such calls, so the k-th one is the same call on
every rank. An announcing rank records the call's name, takes its position p,
and waits before its first collective until every rank has announced the same
call; if another rank instead reaches position p with some other call (it
skipped this one), the announcing rank stops the engine at once, naming the
call, and tears the group down: the other rank's pending collective fails
immediately and its error carries the same message (see ``comm.abort``).

Nothing is mispaired: an announcing rank issues no collective before every
rank has announced the same call. Cost: one store round trip per
communicating engine call (microseconds on one node), a few per announcement.
"""

from __future__ import annotations

import time

from ..distributed.communicator import Communicator

_FIRST_POLL_S, _MAX_POLL_S = 0.002, 0.05

HOW_TO = {
    "model.state_dict()": "call it on every rank, or use model.full_state_dict(rank0_only=True) on "
                          "every rank to get the tensors on rank 0 only",
    "model.full_state_dict()": "call it on every rank (rank0_only=True returns {} on the others)",
    "model.summon_full_params()": "enter it on every rank",
    "model.full_optimizer_state_dict()": "call it on every rank (rank0_only=True returns {} on the "
                                         "others)",
}


class CallAgreement:
    """One engine's announced calls and its position in the sequence (see the Note)."""

    def __init__(self, comm: Communicator, stage: int) -> None:
        self.comm, self.stage = comm, stage
        self.made = 0  # calls this rank announced
        self.active = comm.distributed and comm.world_size > 1 and _store_counts(comm)

    def check(self, engine, what: str) -> None:
        """A communicating engine call (``what``) begins: count it where the others can see it."""
        if self.active:
            self.comm.store_add(self._position_key(self.comm.rank), 1)

    def announce(self, engine, name: str) -> None:
        """Before the collectives of call ``name``: wait until every rank announced it too."""
        if not self.active:
            return
        self.made += 1
        self.comm.store_set(self._name_key(self.comm.rank, self.made), name)  # before the position
        position = self.comm.store_add(self._position_key(self.comm.rank), 1)
        waiting = set(range(self.comm.world_size)) - {self.comm.rank}
        deadline, poll = time.monotonic() + self.comm.timeout_s, _FIRST_POLL_S
        while waiting:
            for rank in sorted(waiting):
                reached = self.comm.store_add(self._position_key(rank), 0)  # read first, then the name
                called = self.comm.store_get(self._name_key(rank, self.made))
                if called is not None and called != name:
                    engine.failure.fail(f"the ranks entered different collective calls (rank {self.comm.rank}: "
                                f"{name}, rank {rank}: {called}); every rank must make the same calls "
                                "in the same order")
                if called is not None:
                    waiting.discard(rank)
                elif reached >= position:
                    engine.failure.fail(self._skipped(name, "went on to its next forward, backward or "
                                                    "optimizer step instead"))
            if waiting and time.monotonic() > deadline:
                engine.failure.fail(self._skipped(name, f"did not call it within the collective timeout "
                                                f"({self.comm.timeout_s:.0f}s)"))
            if waiting:
                time.sleep(poll)
                poll = min(2 * poll, _MAX_POLL_S)

    def _position_key(self, rank: int) -> str:
        return self.comm.store_key(f"calls/position/rank{rank}")

    def _name_key(self, rank: int, number: int) -> str:
        return self.comm.store_key(f"calls/{number}/rank{rank}")

    def _skipped(self, name: str, what_others_did: str) -> str:
        names = {rank: self.comm.store_get(self._name_key(rank, self.made)) for rank in range(self.comm.world_size)}
        callers = [rank for rank, called in names.items() if called == name]
        others = [rank for rank in names if rank not in callers]
        advice = HOW_TO.get(name, "make it on every rank")
        return (f"{name} was called on rank(s) {callers} but not on rank(s) {others}, which "
                f"{what_others_did}. {name} is collective here (stage {self.stage}: it gathers "
                f"every rank's slices); {advice}")


def _store_counts(comm: Communicator) -> bool:
    """Whether the group's store can count (``add``). A fake process group simulating N ranks in
    one process (memory_estimator.measure.validate) has a store without it, and nothing to agree with."""
    try:
        comm.store_add(comm.store_key("calls/probe"), 0)
    except (RuntimeError, NotImplementedError):
        return False
    return True
