"""``JoinState``: what one rank's engine knows about ``model.join()`` (the protocol is join.py).

Its own module so that the engine's typed interface (engine_api.py) can name it without
importing the join protocol, which takes that interface (an import circle otherwise).
"""
from __future__ import annotations

from typing import Optional

import torch

from .phase import StepState


class JoinState:
    """What one rank's engine knows about ``model.join()``."""

    def __init__(self, step_state: StepState) -> None:
        self._step_state = step_state
        self.inside = False           # within the ``with`` body or serving after it
        self.announced = 0            # announcements made while active (the last joiner made most)
        self.last_inputs: Optional[tuple[tuple, dict]] = None  # stage 3: the last training forward's
        self.grad_outputs: Optional[list[int]] = None  # stage 3: outputs that got a gradient
        self._noted_outputs: list[int] = []
        self.replay_outputs: list[torch.Tensor] = []

    @property
    def serving(self) -> bool:
        """This rank has joined: it answers announcements (the step's JOINED phase)."""
        return self._step_state.joined

    @serving.setter
    def serving(self, joined: bool) -> None:
        self._step_state.joined = joined

    @property
    def announcing(self) -> bool:
        return self.inside and not self.serving
