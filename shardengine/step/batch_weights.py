"""Batch weights: each rank's gradient counts by how much data it saw.

[Note: exact global averaging]
Data-parallel engines average ranks' gradients with a plain 1/N, which is the
gradient of the global batch only when every rank's micro-batches are the
same size. Here every micro-step m on rank r has a *weight* w (by default the
number of samples in its inputs, or what ``model.set_batch_weight`` says:
tokens, say) and the reduced gradient of a window is

    sum_{r,m} w_rm g_rm * M / W,       W = sum_{r,m} w_rm,

with g_rm the gradient of that micro-step's loss and M the number of
micro-steps per rank. A loss that is the mean over its micro-batch divided by
M (the usual accumulation recipe) then gives exactly the gradient of the mean
over the union of every rank's micro-batches; equal weights give DDP's
average. A loss that is already a *sum* over its items counts once per
micro-step (``reduction="sum"``) and is divided by the total W.

Cost: gradients are multiplied by w / w_ref before they are reduced, where
w_ref, agreed at the previous step, is the mean weight per micro-step. When
the weights stay what they were (every rank's batches the same size, step
after step) that factor is 1 and nothing is multiplied; the first step, or a
step whose weights changed, pays one pass over the local gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError

REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class MicroStepWeight:
    """How one micro-step's gradient counts: ``factor`` multiplies it, ``count`` adds to W."""

    factor: float
    count: float


@dataclass
class ForwardWeight:
    """The weight of one training forward; the hooks on its outputs carry it to its backward.

    [Note: a backward counts with its own forward's weight]
    Forwards and backwards need not alternate: FairScale's fwd-fwd-bwd-bwd, backwards
    in reverse order, an evaluation forward or a forward whose loss is dropped between
    a forward and its backward. So the weight is not "the latest forward's": each
    training forward gets its own record, the engine's hooks on that forward's outputs
    hold it, and the backward that first reaches those outputs counts with it. A
    backward reaching the outputs of several forwards (one loss over two forwards)
    is one micro-step with the weight of the forward whose output gradient arrives
    first; a backward reaching none (a loss on parameters only) takes a weight set
    with ``set_batch_weight`` since, else the latest forward's.
    """

    weight: float
    reduction: str = "mean"
    given_before: bool = False    # set_batch_weight() before the forward: a later set() is the next one's
    backpropagated: bool = False  # a backward has counted with it

    @property
    def numerator(self) -> float:
        """What the micro-step's factor is ``numerator / reference`` of."""
        return self.weight if self.reduction == "mean" else 1.0


def samples_in(args: tuple, kwargs: dict) -> float:
    """The default weight: the leading dimension of the first tensor among the inputs."""
    leaves, _ = tree_flatten((args, kwargs))
    first = next((leaf for leaf in leaves if torch.is_tensor(leaf)), None)
    return float(first.shape[0]) if first is not None and first.dim() > 0 else 1.0


class BatchWeights:
    """This rank's weights over one window (see the Notes)."""

    def __init__(self) -> None:
        # the weight that counts as factor 1: agreed at each step; None until the first
        # training forward agrees on one (see needs_reference)
        self.reference: Optional[float] = None
        self._pending: Optional[ForwardWeight] = None  # set_batch_weight() for the next forward
        self._latest: Optional[ForwardWeight] = None   # the latest training forward's record
        self.current = MicroStepWeight(1.0, 1.0)
        self.window_weight = 0.0
        self.window_micro_steps = 0

    def set(self, weight: Any, reduction: str = "mean") -> None:
        """``model.set_batch_weight``: the weight of the just-run forward if its backward has not
        started (and it was not given one before it ran), else of the next training forward."""
        if isinstance(weight, torch.Tensor):
            weight = weight.item() if weight.numel() == 1 else weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight < 0:
            raise ConfigError(f"set_batch_weight() takes a finite number >= 0 (samples or tokens in "
                              f"this micro-batch), got {weight!r}")
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        latest = self._latest
        if latest is not None and not latest.backpropagated and not latest.given_before:
            latest.weight, latest.reduction = float(weight), reduction
        else:
            self._pending = ForwardWeight(float(weight), reduction, given_before=True)

    def record_forward(self, args: tuple, kwargs: dict) -> ForwardWeight:
        """A training forward: the weight set for it, else its inputs' sample count."""
        record, self._pending = self._pending, None
        if record is None:
            record = ForwardWeight(samples_in(args, kwargs))
        self._latest = record
        return record

    @property
    def needs_reference(self) -> bool:
        return self.reference is None

    def coming_numerator(self, record: Optional[ForwardWeight] = None) -> float:
        """The numerator of ``record``'s factor (None: of a weight set for what comes next)."""
        record = record or self._pending
        return record.numerator if record is not None else 1.0

    def set_first_reference(self, mean_numerator: float) -> None:
        """The first step's reference: the ranks' mean first weight, so that equal batches get
        factor 1. (A fixed 1 would multiply fp16 gradients, already loss-scaled, by the batch
        size on the first step and overflow them.)"""
        self.reference = mean_numerator if mean_numerator > 0 else 1.0

    def begin_backward(self, record: Optional[ForwardWeight]) -> MicroStepWeight:
        """The weight of a backward that reached ``record``'s outputs (None: none carried one)."""
        if record is None:
            record, self._pending = (self._pending, None) if self._pending is not None else (self._latest, None)
        if record is None:
            record = ForwardWeight(1.0)  # a backward without a forward through the root
        record.backpropagated = True
        if self.reference is None:
            self.reference = 1.0  # nothing was inferred before this backward
        self.current = MicroStepWeight(record.numerator / self.reference, record.weight)
        return self.current

    def end_backward(self) -> None:
        self.window_weight += self.current.count
        self.window_micro_steps += 1

    def divisor(self, total_weight: float, micro_steps: int, ranks_with_micro_steps: int,
                world: int) -> float:
        """What the window's gradients, already averaged over ``world`` ranks, are divided by."""
        if total_weight <= 0 or micro_steps == 0:
            return 1.0  # no data anywhere: every gradient is zero and the step skips them all
        mean_micro_steps = micro_steps / ranks_with_micro_steps
        return total_weight / (world * (self.reference or 1.0) * mean_micro_steps)

    def end_window(self, total_weight: float, micro_steps: int) -> None:
        """The next window's reference: this one's mean weight per micro-step."""
        if total_weight > 0 and micro_steps > 0:
            self.reference = total_weight / micro_steps
        self.discard_window()

    def discard_window(self) -> None:
        """The window's gradients are gone (a step, or zero_grad without one)."""
        self.window_weight, self.window_micro_steps = 0.0, 0
