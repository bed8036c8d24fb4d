"""Learning-rate schedulers built on the user's optimizer, moved to the one ``shard()`` returns.

[Note: why trainers need this]
Both trainers build the optimizer and its scheduler together, before the
engine sees either (Lightning's ``configure_optimizers`` returns both; a
``transformers.Trainer`` may be given ``optimizers=(opt, sched)``). At stages
1-3 ``shard()`` returns a new optimizer over this rank's slices, so a scheduler
left pointing at the user's optimizer would change learning rates nobody
reads. Retargeting points the scheduler at the returned optimizer: its param
groups carry the same hyperparameters (``initial_lr`` included, which the
scheduler wrote into the user's groups), so the schedule continues unchanged.
torch's ``LRScheduler`` marks the optimizer's ``step`` to warn when the
scheduler steps first; the mark is carried over so that warning stays right.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch

# The attribute torch's LRScheduler puts on the optimizer.step it wraps (torch/optim/lr_scheduler.py),
# and the flag that wrapper sets on the optimizer when it runs.
_STEP_MARK = "_wrapped_by_lr_sched"
_STEP_CALLED = "_opt_called"


def retarget_schedulers(schedulers: Iterable[Any], old: torch.optim.Optimizer,
                        new: torch.optim.Optimizer) -> int:
    """Point every scheduler built on ``old`` at ``new``; return how many were moved.

    A scheduler already on ``new`` (or on another optimizer) is left alone, so this is
    safe to call whatever ``shard()`` returned.

    >>> import torch
    >>> net = torch.nn.Linear(2, 1)
    >>> old = torch.optim.SGD(net.parameters(), lr=1.0)
    >>> sched = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.5)
    >>> new = torch.optim.SGD([{**g} for g in old.param_groups])
    >>> retarget_schedulers([sched], old, new)
    1
    >>> new.step(); sched.step(); new.param_groups[0]["lr"]
    0.5
    """
    if old is new:
        return 0
    moved = 0
    for scheduler in schedulers:
        if scheduler is None or getattr(scheduler, "optimizer", None) is not old:
            continue
        scheduler.optimizer = new
        moved += 1
    if moved and hasattr(old.step, _STEP_MARK) and not hasattr(new.step, _STEP_MARK):
        _mark_step(new)
    return moved


def _mark_step(optimizer: torch.optim.Optimizer) -> None:
    step = optimizer.step

    @functools.wraps(step)
    def marked_step(*args, **kwargs):
        setattr(optimizer, _STEP_CALLED, True)
        return step(*args, **kwargs)

    setattr(marked_step, _STEP_MARK, True)
    optimizer.step = marked_step
