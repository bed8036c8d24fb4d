"""Stage 3: parameters used outside their unit's forward, gathered where they are used.

[Note: external parameters]
A unit's parameters are gathered around its forward and freed after it, so a use
anywhere else found only this rank's slice: the parent reading
``self.linear1.weight`` after ``linear1`` ran (DeepSpeed's ``test_ext_param_getattr``),
a module returning its own bias for the parent to add (``test_ext_param_return``),
a method other than ``forward`` (``self.vit.forward_features(x)``). DeepSpeed
registers such "external parameters" and trains them; so here: a read of a sharded
parameter inside the model's forward or backward, or inside any unit's forward (a
unit called on its own: a head whose weight, tied to the embedding, lives in the
root unit) gathers the parameter's unit at once (a collective like any gather, in the
order every rank follows: distributed/sequence.py), and the unit is then *held*:
not freed after its own forward nor when its gradients arrive, since autograd may
still read the parameter for the external use's backward, but at the end of
backward (after an evaluation forward, at the end of that forward). Values and
gradients are exact; the cost is that unit's memory from the use to the end of
backward. Between steps a read stays a ShardedAccessError (summon_full_params()).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ..flat import guard
from ..flat.units import Unit, in_backward


class ExternalUses:
    """The units gathered for a use outside their own forward, held until backward ends."""

    def __init__(self, units: Callable[[], list[Unit]], gather: Callable[[Unit], None],
                 free: Callable[[Unit], None], in_forward: Callable[[], bool], check_usable: Callable[[], None]):
        """``units()``: the scheduler's units; ``gather``/``free`` one; ``in_forward()``: the
        model's forward runs; ``check_usable`` raises where the engine stopped."""
        self.units, self._gather, self._free = units, gather, free
        self.in_forward, self.check_usable = in_forward, check_usable
        self.held: set[Unit] = set()
        self.calls_open = 0  # unit forwards running (a unit called on its own counts too)

    def attach(self) -> None:
        """Every sharded parameter gathers its unit on a use where that is right (see the Note)."""
        # The guard table is global: what it holds must not keep the engine alive, nor the
        # module (a unit holds its module, whose hooks hold the engine): a weak reference and
        # the unit's index, never the unit.
        me = weakref.ref(self)
        for index, unit in enumerate(self.units()):
            for bucket in unit.buckets:
                for param in bucket.params:
                    state = guard.state_of(param)
                    if state is not None:
                        state.gather_on_access = _gatherer(me, index)

    def gather(self, unit: Unit) -> bool:
        if not (self.in_forward() or self.calls_open or in_backward()):
            return False  # between steps: the ShardedAccessError says what to do
        self.check_usable()
        self._gather(unit)
        self.held.add(unit)
        return True

    def left_call(self) -> None:
        """A unit's forward returned; one called on its own outside the model's forward (a head
        per chunk of a loss) ends an evaluation use there."""
        self.calls_open = max(self.calls_open - 1, 0)
        if not (self.calls_open or self.in_forward() or in_backward()):
            self.forward_done()

    def forward_done(self) -> None:
        """After an evaluation forward nothing will read them again: free them now."""
        if not torch.is_grad_enabled():
            for unit in self.held:
                self._free(unit)
            self.held.clear()


def _gatherer(me: "weakref.ref[ExternalUses]", index: int) -> Callable[[], bool]:
    def gather() -> bool:
        uses = me()
        return uses is not None and uses.gather(uses.units()[index])
    return gather
