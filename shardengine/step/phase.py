"""Where one rank's training step is: the :class:`Phase` enum and its legal transitions.

[Note: the step's phases]
A gradient window (the micro-steps between two optimizer steps) moves through

    IDLE --backward--> BACKWARD --ends--> ACCUMULATED --agreement--> REDUCED --clip--> CLIPPED
      ^                   ^  |                 |                       |  |               |
      |                   +--|-----------------+ (another micro-step)  |  |               |
      |                   +--|-----------------------------------------+  | (reopened:    |
      |                      |                                            |  divided back)|
      +---------- optimizer step or zero_grad (ends the window) ----------+---------------+

``REDUCED`` means the window's agreement ran (step/agreement.py) and its
gradients are divided once (see [Note: gradient windows] in stages/window.py);
at stage 0 a synchronizing backward gets there by itself (DDP's ``p.grad`` is
the average). ``CLIPPED`` is REDUCED after ``clip_grad_norm_`` scaled the
gradients: a backward then would add unclipped gradients to clipped ones, so it
is refused while the window holds reduced gradients. The optimizer step ends
the window (there is no separate "stepped" phase to wait in: after the step the
window is IDLE again).

Three more phases lie *over* the window instead of replacing it, because the
window must resume unchanged when they end: ``FORWARD`` (a training forward is
running; nested forwards count), ``SUMMONED`` (inside ``summon_full_params()``:
parameters hold full copies, so forward is refused) and ``JOINED`` (this rank
ran out of data and serves the others' collectives, step/join.py). ``BROKEN`` is
final: the rank's collectives can no longer be paired with the others', and
every later engine call raises why.

The window's transitions live in ``_LEGAL`` below, and only :meth:`StepState.move`
changes the window, so a new entry point cannot quietly reach an illegal
phase; the user-facing errors for illegal calls (a step during backward, a
backward after clipping) stay in the engine, which knows what to tell the user.
"""

from __future__ import annotations

import enum
from typing import Optional

from ..errors import CollectiveError


class Phase(enum.Enum):
    """A phase of one rank's step (see the module's Note)."""

    IDLE = "idle"                # a fresh window: no gradient kept since the last step
    BACKWARD = "backward"        # a backward pass is running; reductions overlap it
    ACCUMULATED = "accumulated"  # gradients kept (reduced or local), not yet agreed on
    REDUCED = "reduced"          # agreed on and divided once: ready for clip and step
    CLIPPED = "clipped"          # REDUCED, and clip_grad_norm_ scaled the gradients
    FORWARD = "forward"          # over the window: a training forward is running
    SUMMONED = "summoned"        # over the window: inside summon_full_params()
    JOINED = "joined"            # over the window: serving the others in model.join()
    BROKEN = "broken"            # final: see StepState.fail


WINDOW = (Phase.IDLE, Phase.BACKWARD, Phase.ACCUMULATED, Phase.REDUCED, Phase.CLIPPED)
NORMALIZED = (Phase.REDUCED, Phase.CLIPPED)  # the window's gradients are divided once

_LEGAL: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.BACKWARD, Phase.REDUCED, Phase.IDLE}),
    Phase.BACKWARD: frozenset({Phase.ACCUMULATED}),
    Phase.ACCUMULATED: frozenset({Phase.BACKWARD, Phase.REDUCED, Phase.IDLE}),
    Phase.REDUCED: frozenset({Phase.BACKWARD, Phase.CLIPPED, Phase.IDLE}),
    Phase.CLIPPED: frozenset({Phase.BACKWARD, Phase.CLIPPED, Phase.IDLE}),
}


class StepState:
    """One rank's phase: the window's, and what lies over it.

    >>> state = StepState()
    >>> state.move(Phase.BACKWARD); state.move(Phase.ACCUMULATED); state.move(Phase.REDUCED)
    >>> state.phase, state.normalized
    (<Phase.REDUCED: 'reduced'>, True)
    >>> state.move(Phase.ACCUMULATED)
    Traceback (most recent call last):
    ...
    RuntimeError: step phase: reduced cannot go to accumulated (legal: backward, clipped, idle)
    """

    def __init__(self) -> None:
        self.window = Phase.IDLE
        self.forward_depth = 0                 # training forwards running (nested ones count)
        self.summoned = False                  # inside summon_full_params()
        self.joined = False                    # serving the others inside model.join()
        self.broken: Optional[str] = None      # why this rank stopped for good

    @property
    def phase(self) -> Phase:
        """The phase a user would name: what lies over the window first, else the window's."""
        if self.broken is not None:
            return Phase.BROKEN
        if self.summoned:
            return Phase.SUMMONED
        if self.joined:
            return Phase.JOINED
        if self.forward_depth:
            return Phase.FORWARD
        return self.window

    @property
    def in_backward(self) -> bool:
        return self.window is Phase.BACKWARD

    @property
    def normalized(self) -> bool:
        """The window's agreement ran and its gradients are divided once."""
        return self.window in NORMALIZED

    def move(self, to: Phase) -> None:
        """Change the window's phase; an illegal transition is a bug in the engine."""
        legal = _LEGAL[self.window]
        if to not in legal:
            raise RuntimeError(f"step phase: {self.window.value} cannot go to {to.value} "
                               f"(legal: {', '.join(sorted(p.value for p in legal))})")
        self.window = to

    def end_window(self) -> None:
        """The optimizer step or ``zero_grad`` consumed the gradients (a backward that is
        still running keeps its phase: its end moves the window on)."""
        if self.window is not Phase.BACKWARD:
            self.move(Phase.IDLE)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise CollectiveError(self.broken)
