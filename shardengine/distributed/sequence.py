"""``CollectiveSequence``: before each collective, the ranks check that they all issue the same one.

[Note: checked collective order]
Ranks pair collectives by the order they issue them. At stages 0-2 that order is
fixed by the plan, but at stage 3 it follows the model: a rank gathers a unit when
its forward calls the unit. Ranks that run different modules (DeepSpeed's
``test_choose_module_by_rank``: rank r runs ``linears[r % 2]``; any mixture of
experts whose experts are separate units run by routing) would pair one rank's
gather of unit 0 with another's of unit 1: of equal size, the two mix into
silently wrong parameters; of different sizes, Gloo aborts the process or fills
half a buffer, NCCL hangs. Checking after the fact cannot help (the collective
itself is the harm), so at stage 3 each collective is preceded by a *round*: one
small all-gather, on a Gloo group of its own, of what each rank is about to issue
(an :data:`OpId`: gather bucket b, reduce bucket b, or a kind and a size). Every
rank sees every rank's next collective before any of them is issued, so a
mismatch is known to all at once and nothing is mispaired:

* all ranks issue the same collective: it is issued (the common case: one round);
* some ranks gather a bucket the others do not need now: those gathers are
  *served* (``server``): every rank takes part in each one, in one order derived
  from the round, so the ranks that needed them get exact values; ranks whose own
  collective was not among them hold a new round. So a model whose ranks run
  different units trains exactly as on one process, instead of failing;
* a rank whose collective cannot be served (a reduction, the step's agreement)
  waits in rounds, serving the others' gathers, until every rank asks for the
  same one; ``agree_values`` lets the ranks exchange a value where they may
  differ (the reduction order, stages/unit_order.py);
* ranks asking for different collectives none of which can be served are out of
  step for good: every rank raises the same ``CollectiveError``, naming each
  rank's collective (``describe``).

Collectives issued inside an agreed one (the parts of a compressed gather) or a
served one need no round of their own. A round costs one all-gather of 24 bytes
per rank on a separate Gloo group (on the host, so it never waits for a device
stream), paid once per stage-3 collective.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, TypeVar

import torch

from ..errors import CollectiveError

GATHER, REDUCE, VALUE, OTHER = 1, 2, 3, 4  # the kinds of OpId
OpId = tuple[int, int, int]  # (kind, key, size or value): what a rank is about to issue
T = TypeVar("T")

_KIND_NAMES = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "all_to_all": 4, "broadcast": 5}
OBJECTS: OpId = (OTHER, 6, 0)  # an all-gather of Python objects (control messages, checkpoints)


def other_op(kind: str, nbytes: int) -> OpId:
    """The id of a collective no one serves: its kind and size (equal on every rank in step)."""
    name = kind.split(" ")[0]
    return (OTHER, _KIND_NAMES.get(name, 0), int(nbytes))


class CollectiveSequence:
    """Rounds before collectives (see the Note). ``side``: a communicator over a Gloo group of
    all ranks, used for nothing else; ``server(op)`` takes part in another rank's gather;
    ``describe(op)`` names a collective for an error."""

    def __init__(self, side, server: Callable[[OpId], None], describe: Callable[[OpId], str]):
        self.side, self.server, self.describe = side, server, describe
        self.enabled = False   # switched on once the engine is built (wrap-time collectives agree)
        self.rounds = 0        # rounds held (one per collective when the ranks agree)
        self.served = 0        # gathers this rank took part in for another rank
        self._inside = 0       # depth of agreed or served collectives being issued
        # the round's two host buffers, made once: a round allocates nothing (rounds never nest)
        self._mine = torch.zeros(3, dtype=torch.int64)
        self._everyone = torch.zeros(3 * side.world_size, dtype=torch.int64)

    @contextlib.contextmanager
    def agreed(self) -> Iterator[None]:
        """Collectives issued inside are parts of one already agreed (or served): no round."""
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    @property
    def active(self) -> bool:
        return self.enabled and not self._inside

    def run(self, op: OpId, issue: Callable[[], T]) -> T:
        """Issue ``issue()`` (the collective ``op``) once every rank issues the same collective."""
        if not self.active:
            return issue()
        while True:
            everyone = self._round(op)
            if all(other == op for other in everyone):
                with self.agreed():
                    return issue()
            served = self._serve(everyone, op, issue)
            if served is not None:
                return served[0]
            self._refuse_unless_servable(everyone)

    def agree_values(self, key: int, value: int) -> list[int]:
        """Every rank's ``value`` for ``key``, once all ranks ask (serving gathers meanwhile)."""
        if not self.active:
            return [value]
        op = (VALUE, key, value)
        while True:
            everyone = self._round(op)
            if all(other[:2] == op[:2] for other in everyone):
                return [other[2] for other in everyone]
            if self._serve(everyone, op, lambda: None) is None:
                self._refuse_unless_servable(everyone)

    def _round(self, op: OpId) -> list[OpId]:
        """Every rank's ``op``, in rank order (the side group's one collective)."""
        self.rounds += 1
        for index, value in enumerate(op):
            self._mine[index] = value
        self.side.all_gather_small(self._mine, self._everyone)
        return [tuple(row) for row in self._everyone.view(-1, 3).tolist()]

    def _serve(self, everyone: list[OpId], mine: OpId, issue: Callable[[], T]) -> Optional[tuple[T]]:
        """Take part in every gather asked for in this round, in one order on every rank; this
        rank's own when its turn comes. ``(result,)`` if its own collective was among them."""
        gathers = sorted({op for op in everyone if op[0] == GATHER})
        result: Optional[tuple[T]] = None
        for op in gathers:
            with self.agreed():
                if op == mine:
                    result = (issue(),)
                else:
                    self.served += 1
                    self.server(op)
        return result if gathers else None

    def _refuse_unless_servable(self, everyone: list[OpId]) -> None:
        if any(op[0] == GATHER for op in everyone):
            return  # gathers were served: the others ask again
        rows = "; ".join(f"rank {rank}: {self.describe(op)}" for rank, op in enumerate(everyone))
        raise CollectiveError(
            f"the ranks are about to issue different collectives ({rows}), and none of them can be "
            "served for the others, so nothing was issued. A rank ran a different sequence of "
            "forwards, backwards, steps or collective calls (state_dict(), summon_full_params()) "
            "than the others; every rank must run the same ones (model.join() for uneven data). "
            "Resume from the last checkpoint.")

