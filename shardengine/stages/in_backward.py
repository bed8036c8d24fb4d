"""The optimizer step inside backward (``shard(..., step_in_backward=True)``, stages 1-3).

[Note: the step inside backward]
Each bucket's reduced gradient slice is stepped where it lands (``_keep`` in
stages/gradients.py; at stage 3 the buckets of a unit) and freed at once, so the
gradients never exist whole: the peak of backward is that of the states, plus
the buckets in flight. torchtune's ``optimizer_in_bwd`` and LOMO do the same on
one device. Each bucket is stepped in capped runs of its pieces, so the step's
temporaries stay small where they now land, amid backward (optim/step_groups.py). The result equals a plain step after backward because the bucketed
step (optim/bucketed_step.py) is exact bucket by bucket; what the plain step
decides *after* all gradients are reduced is decided here as follows:

* batch weights, the ranks' progress counters and the hyperparameter digest
  (step/agreement.py) are agreed before this backward's first reduction, from
  what is known then: each rank's weight is fixed once its backward starts
  (step/batch_weights.py). So every slice is divided by the exact divisor when
  it lands.
* a parameter no rank used must not be stepped (torch skips a parameter whose
  grad is None). A bucket every one of whose parameters got a gradient on this
  rank holds only parameters used somewhere: it is stepped at once. Any other
  bucket keeps its slice until backward ends, when a second small all-reduce
  of the used flags (the same vector) tells which parameters no rank used; it
  is stepped then, skipping those.
* at the end of backward the updated values are published (stages 1-2
  all-gather them; stage 3 gathers on use), the step is counted and the window
  ends. ``optimizer.step()`` then runs the user's step hooks and nothing else
  (an LR scheduler's step takes effect at the next backward, as with
  torchtune); ``zero_grad()`` has nothing left to free.

What needs every gradient at once, or several backward passes per step, cannot
be combined with it and is refused with a ConfigError (``refuse``): global-norm
clipping, ``no_sync()`` and other accumulation over micro-steps, ``join()``,
fp16 loss scaling (an overflow skips a step that is already taken), optimizer
offload, whole-tensor and unknown optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ..distributed.hybrid import HybridCommunicator
from ..errors import ConfigError
from ..flat.bucket import Buckets, FlatBucket
from ..step.agreement import Announcement, Contribution, ProgressCounters, exchange
from ..step.batch_weights import BatchWeights
from .params import ParamIndex

OPTION = "step_in_backward=True"


def refuse(conflict: str, instead: str) -> ConfigError:
    """The error for a feature that cannot be combined with the step inside backward."""
    return ConfigError(f"{conflict} cannot be combined with {OPTION}: the optimizer step runs inside "
                       f"backward, bucket by bucket, as each gradient lands. {instead}")


class Window(Protocol):
    """What the step inside backward asks of the gradient window (window.py)."""

    totals: tuple[float, int]
    unused: set[int]

    def check_local(self) -> None: ...

    def hyper_digest(self) -> float: ...

    def note_held(self, ranks_using: list[int], no_data: bool = False) -> None: ...

    def end(self) -> None: ...


class BucketStepper(Protocol):
    """What it asks of the optimizer's steps (stepping.py)."""

    def step_bucket_now(self, bucket: FlatBucket) -> None: ...

    def publish_stepped(self) -> None: ...


class GradientRelease(Protocol):
    """What it asks of the stage's gradient path (gradients.py)."""

    def release(self, bucket: FlatBucket) -> None: ...


@dataclass(frozen=True)
class InBackwardSources:
    """What the step inside backward uses: the stage's facts as data, the step's state and
    the collaborators it calls."""

    enabled: bool                      # ``step_in_backward=True``
    whole_tensor_groups: frozenset     # param groups whose optimizer needs whole tensors
    divides_on_landing: bool           # StageSpec: each reduction is averaged as it lands
    reduces_every_micro_step: bool     # StageSpec: the reduced slice is a buffer of its own
    comm: HybridCommunicator
    counters: ProgressCounters
    weights: BatchWeights
    params: ParamIndex
    window: Window
    stepping: BucketStepper
    grads: GradientRelease
    sync_device: Callable[[], torch.device]  # where the agreement's tensors live (forward.py)
    stepped_buckets: Buckets  # the buckets with a master, as the plan is now


class StepInBackward:
    """The engine's collaborator for ``step_in_backward``: agree, step on landing, finish."""

    def __init__(self, sources: InBackwardSources):
        self.sources = sources
        self.divisor: Optional[float] = None  # agreed before this backward's first reduction
        self.no_data = False                  # every rank's batch weight is 0: nothing is stepped
        self.awaiting_user_step = False       # stepped in backward; optimizer.step() comes next

    @property
    def enabled(self) -> bool:
        return self.sources.enabled

    def check_optimizer(self, members: list, bucketed: list) -> None:
        """At ``shard()``: every member must step bucket by bucket, element-wise."""
        if not self.enabled:
            return
        if self.sources.whole_tensor_groups:
            raise refuse("a whole-tensor optimizer (Muon, Adafactor, whole_tensor_optimizers)",
                         "Use an element-wise optimizer (AdamW, Adam, SGD, ...) or drop step_in_backward.")
        unknown = [type(m).__name__ for m in members if not any(m is b for b in bucketed)]
        if unknown:
            raise refuse(f"the optimizer {unknown[0]} (not a torch optimizer known to step bucket by "
                         "bucket; subclasses and unknown classes are stepped once over everything)",
                         "Use one of torch's element-wise optimizer classes itself, or drop step_in_backward.")

    # ------------------------------------------------------------------ the user's calls

    def check_backward(self) -> None:
        """A backward starts: the previous one's step must have been acknowledged by ``optimizer.step()``."""
        if self.enabled and self.awaiting_user_step:
            raise refuse("a second backward before optimizer.step() (gradient accumulation over "
                         "micro-steps)", "Call optimizer.step() after every backward, or drop "
                         "step_in_backward to accumulate (each backward is one optimizer step here).")

    def check_zero_grad(self) -> None:
        if self.enabled and self.awaiting_user_step:
            raise refuse("zero_grad() between backward and optimizer.step() (discarding the gradients)",
                         "The step was already taken; call optimizer.step() first, then zero_grad().")

    def user_step(self) -> None:
        """``optimizer.step()``: the step was taken in backward; its hooks run around nothing."""
        self.awaiting_user_step = False

    # ------------------------------------------------------------------ during backward

    def before_first_reduction(self) -> None:
        """Agree on the window's weights, counters and hyperparameters (see the Note)."""
        if not self.enabled or self.divisor is not None:
            return
        sources = self.sources
        window, world = sources.window, sources.comm.world_size
        window.check_local()
        mine = Contribution(sources.counters, bytearray(), Announcement.SYNC, weight=sources.weights.current.count,
                            micro_steps=1, hyper_digest=window.hyper_digest())
        agreement = exchange(sources.comm, mine, sources.sync_device())
        window.totals = (agreement.weight, agreement.micro_steps)
        self.no_data = agreement.weight <= 0
        kept_sum = 1.0 if sources.divides_on_landing else float(world)
        self.divisor = kept_sum * sources.weights.divisor(agreement.weight, agreement.micro_steps,
                                                          agreement.ranks_with_micro_steps, world)

    def landed(self, bucket: FlatBucket) -> None:
        """``bucket``'s reduced slice is in ``grad_shard``: divide it; step it now if it can be."""
        if not self.enabled or bucket.grad_shard is None:
            return
        if self.divisor != 1.0:
            bucket.grad_shard.div_(self.divisor)
        params = self.sources.params
        used_here = all(params.used_flags[params.flag_of[id(p)]] for p in bucket.params)
        if used_here and not self.no_data and bucket.master is not None:
            self._step(bucket)

    def _step(self, bucket: FlatBucket) -> None:
        self.sources.stepping.step_bucket_now(bucket)
        if self.sources.reduces_every_micro_step and bucket.grad_home is None:
            # Stages 2-3: the slice is a buffer of its own that nothing reads any more. Freed
            # here and now: the finished reduce-scatter's handle holds it too, and may drop it
            # last, on the backend's thread, later (stage 1's slice views its kept gradient).
            bucket.grad_shard.untyped_storage().resize_(0)
        self._free(bucket)

    def _free(self, bucket: FlatBucket) -> None:
        for param in bucket.params:
            param.grad = None  # stage 1's adopted gradients view the buffer released next
        self.sources.grads.release(bucket)

    def finish(self) -> None:
        """Backward is over: step what waited for the used flags, publish, count, end the window."""
        if not self.enabled:
            return
        sources = self.sources
        window = sources.window
        window.check_local()  # a parameter that became trainable got its first gradient since
        mine = Contribution(sources.counters, sources.params.used_flags, Announcement.SYNC,
                            hyper_digest=window.hyper_digest())
        agreement = exchange(sources.comm, mine, sources.sync_device())
        window.unused = {id(p) for p, users in zip(sources.params.trainable, agreement.ranks_using)
                         if users == 0 or self.no_data}
        window.note_held(agreement.ranks_using, self.no_data)
        for bucket in sources.stepped_buckets():
            if bucket.grad_shard is not None and not bucket.window_fresh and not self.no_data:
                self._step(bucket)
            else:
                self._free(bucket)
        sources.stepping.publish_stepped()
        sources.counters.steps += 1
        self.divisor, self.no_data, self.awaiting_user_step = None, False, True
        window.end()
