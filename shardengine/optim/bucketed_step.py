"""The optimizer step run one flat bucket at a time, so its temporaries stay one bucket's worth.

[Note: a bounded step]
One ``optimizer.step()`` over every owned piece at once allocates, before any
element is written, an fp32 copy of each gradient shard (the pieces' ``.grad``
under mixed precision) and the optimizer's own temporaries over everything it
steps: torch's ``foreach`` Adam builds ``_foreach_sqrt`` of every
``exp_avg_sq`` in the group. Both scale with the whole shard. FSDP2 has neither
(its gradients are fp32 already; its optimizer steps the per-parameter shards).

So the engine steps bucket by bucket: the bucket's pieces get their gradients,
the optimizer's own (unhooked) step runs over its param groups narrowed to that
bucket's pieces (``only_params``: a step costs its bucket's pieces, not a scan of
every piece per bucket), and the gradients are dropped before the next bucket. The working set is one bucket's fp32 gradient
plus the temporaries over one bucket. The values are bit-identical to one step
over everything: these optimizers update each parameter from its own gradient
and state only (element-wise, or whole-tensor with the owner layout), each
keeps its own ``step`` count, and a foreach kernel computes each element alone.

Only exact torch classes whose step is known to work that way are stepped
bucket by bucket (``steps_bucket_by_bucket``); a subclass may override
``step()`` and call ``super().step()``, which would run every hook once per
bucket, and an unknown class may not be per-parameter. Those keep one step over
everything (stages/stepping.py hands all gradients before it).

What the user sees is unchanged: ``optimizer.step(closure)`` runs the global
and the optimizer's step hooks once, around all buckets (torch's own
``Optimizer.profile_hook_step`` wraps the loop), evaluates the closure once,
and returns its loss. The step is an attribute of the instance (as an LR
scheduler's own step wrapper is); it records ``_opt_called`` and carries
``_wrapped_by_lr_sched`` as that wrapper does, so schedulers built before or
after ``shard()`` see their optimizer step.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Optional

import torch

from .rebuild import ELEMENTWISE_OPTIMIZERS
from .whole_tensor import WHOLE_TENSOR_OPTIMIZERS

# step_buckets(run_step): hands each bucket's gradients, calls run_step(), drops them.
BucketStepper = Callable[[Callable[[], None]], None]


def steps_bucket_by_bucket(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may be stepped one bucket at a time (see the Note)."""
    hooked = type(optimizer).step
    return type(optimizer) in ELEMENTWISE_OPTIMIZERS + WHOLE_TENSOR_OPTIMIZERS \
        and getattr(hooked, "hooked", False) and hasattr(hooked, "__wrapped__")


def install(optimizer: torch.optim.Optimizer, step_buckets: BucketStepper) -> None:
    """Make ``optimizer.step`` run its own step once per bucket, through ``step_buckets``."""
    unhooked = type(optimizer).step.__wrapped__  # the class's step without torch's hook wrapper

    def each_bucket(self: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:  # as torch's steps evaluate it: once, with gradients on
            with torch.enable_grad():
                loss = closure()
        step_buckets(lambda: unhooked(self))
        return loss

    hooked_loop = torch.optim.Optimizer.profile_hook_step(each_bucket)

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._opt_called = True  # what an LR scheduler's step wrapper records
        return hooked_loop(self, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # a scheduler then leaves this step as it is
    optimizer.step = types.MethodType(step, optimizer)


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer``'s own step without torch's hooks (for an optimizer ``steps_bucket_by_bucket``)."""
    unhooked = type(optimizer).step.__wrapped__
    return lambda: unhooked(optimizer)


@contextlib.contextmanager
def only_params(optimizer: torch.optim.Optimizer, group: int, params: list) -> Iterator[None]:
    """Inside: ``optimizer``'s param group ``group`` holds only ``params`` and the others none.
    The group dicts stay the same objects (their hyperparameters, as schedulers set them)."""
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for index, g in enumerate(optimizer.param_groups):
            g["params"] = params if index == group else []
        yield
    finally:
        for g, kept in zip(optimizer.param_groups, saved):
            g["params"] = kept
