"""A gradient window's end: wait, agree with the other ranks, normalize once; and its reset.

[Note: gradient windows]
Reduced gradients accumulate in each bucket's ``grad_shard`` over the
micro-steps of one window; the optimizer step (or ``zero_grad``) ends the
window. With fp16 they stay multiplied by the loss scale until the window's
first ``clip_grad_norm_`` or step unscales them once, so accumulating several
reductions stays linear. The window ends with one small all-reduce shared by
every rank (see step/agreement.py): which parameters got a gradient anywhere, fp16
overflow, and a check that the ranks are in step. See also [Note: the step's
phases] in step/phase.py. Stages differ here only in ``spec.divides_on_landing``
(stage 1 keeps reduced sums until the step) and ``spec.keeps_full_grads``
(stages 0-1 keep a persistent full gradient to zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ..distributed.hybrid import HybridCommunicator
from ..errors import ConfigError
from ..flat import guard
from ..flat.bucket import Buckets, FlatBucket
from ..step import join
from ..step.agreement import Announcement, Contribution, ProgressCounters, exchange
from ..step.batch_weights import BatchWeights
from ..step.join_state import JoinState
from ..step.mixed_precision import DynamicLossScaler
from ..step.phase import Phase, StepState
from . import carried_grads
from .failure import FailureHandling
from .params import ParamIndex


class Reducer(Protocol):
    """What the window asks of the reductions in flight (step/reducer.py)."""

    def wait_all(self) -> None: ...


class OptimizerPath(Protocol):
    """What it asks of the optimizer's steps (stepping.py)."""

    @property
    def rebuilds_optimizer(self) -> bool: ...


class ZeroGradCheck(Protocol):
    """What it asks of the step inside backward (in_backward.py)."""

    def check_zero_grad(self) -> None: ...


class GradientStore(Protocol):
    """What it asks of the stage's gradient path (gradients.py)."""

    def adopts(self, bucket: FlatBucket) -> bool: ...

    def release(self, bucket: FlatBucket) -> None: ...


@dataclass(frozen=True)
class WindowSources:
    """What the gradient window uses: the stage's facts as data, the step's state, and
    callables for what the engine makes or replaces later (the plan grows, the optimizer is
    wrapped after ``shard()``) or what needs the whole engine (the call agreement, replan.py).
    The partners built after the window come through ``GradientWindow.connect``."""

    divides_on_landing: bool           # StageSpec: reductions are averaged as they land
    keeps_full_grads: bool             # StageSpec: stages 0-1 keep a full gradient to zero
    separate_master: bool              # the optimizer steps an fp32 master apart from the params
    comm: HybridCommunicator
    step_state: StepState
    join_state: JoinState
    counters: ProgressCounters
    weights: BatchWeights
    params: ParamIndex
    scaler: Optional[DynamicLossScaler]  # fp16 only
    failure: FailureHandling
    buckets: Buckets          # every bucket of the plan, as it is now
    optimizer: Callable[[], Optional[torch.optim.Optimizer]]  # the wrapped one, once there is one
    sync_device: Callable[[], torch.device]          # where the agreement's tensors live (forward.py)
    check_call: Callable[[str], None]                # a communicating call begins (step/call_agreement.py)
    plan_digest: Callable[[], float]                 # replan.plan_digest
    changed_trainable: Callable[[], list[str]]       # replan.changed_inside_window
    grouped_params: Callable[[], list[list]]         # the user's param groups, add_param_group'd ones too


class GradientWindow:
    """Normalization of the window's gradients, and the checks made once per window.

    [Note: partners wired after construction]
    The hooks and the window call collaborators that are built after them and call them
    back (the reducer, the layout, the gradient path, the optimizer's steps, the step
    inside backward). Those come through ``connect``, which StageEngine.__init__ calls
    once, right after all of them exist and before any hook is registered; they are
    never replaced afterwards. What the engine does replace (the bucket list replan.py
    grows, the optimizer wrapped after ``shard()``) is read through a callable at each use.
    """

    def __init__(self, sources: WindowSources):
        self.sources = sources
        self.reducer: Reducer             # the partners: see ``connect``
        self.stepping: OptimizerPath
        self.in_backward: ZeroGradCheck
        self.gradient_path: GradientStore
        self.applied_divisor = 1.0       # what the window's gradients were divided by
        self.found_inf = False           # fp16: the window's agreement saw an overflow
        self.unused: set[int] = set()    # ids of params that got no gradient on any rank
        self.totals: tuple[float, int] = (0.0, 0)  # the agreed window weight and micro-steps
        self.param_versions: list[int] = []  # with a separate master: the engine's last writes

    def connect(self, reducer: Reducer, stepping: OptimizerPath, in_backward: ZeroGradCheck,
                gradient_path: GradientStore) -> None:
        """The partners built after the window (see [Note: partners wired after construction])."""
        self.reducer, self.stepping, self.in_backward = reducer, stepping, in_backward
        self.gradient_path = gradient_path

    def reopen(self) -> None:
        """A backward in a window already normalized (stage 0 after a synchronizing backward,
        or after the step's agreement): take the division back, so accumulation stays linear."""
        state = self.sources.step_state
        if not state.normalized or all(b.window_fresh for b in self.sources.buckets()):
            return
        if state.window is Phase.CLIPPED:
            raise RuntimeError("a backward pass after clip_grad_norm_() in the same accumulation "
                               "window; call the optimizer step (or zero_grad) before the next backward")
        if self.applied_divisor != 1.0:
            carried_grads.take_back(self.sources.buckets(), self.applied_divisor)
            for grad in self.grads():
                grad.mul_(self.applied_divisor)
        self.applied_divisor = 1.0

    def _divisor(self) -> float:
        """What stored gradients must still be divided by (see [Note: gradient windows]): the
        fp16 loss scale, and the rank count where reductions kept the sum."""
        sources = self.sources
        scale = sources.scaler.scale if sources.scaler is not None else 1.0
        return scale if sources.divides_on_landing else scale * sources.comm.world_size

    def finish_gradient_sync(self) -> None:
        """Wait for reductions in flight, agree with the other ranks (step/agreement.py) and
        normalize the window's gradients once."""
        sources = self.sources
        sources.failure.check_usable()
        if sources.step_state.in_backward:
            raise RuntimeError("the optimizer step (or clip_grad_norm_) was called during backward")
        sources.check_call("an optimizer step (or clip_grad_norm_)")
        self.reducer.wait_all()
        if sources.step_state.normalized:
            return
        self.check_local()
        grads = self.grads()
        overflow = sources.scaler is not None and _any_nonfinite(grads)
        mine = Contribution(sources.counters, sources.params.used_flags, Announcement.SYNC,
                            active=not sources.join_state.serving, overflow=overflow,
                            weight=sources.weights.window_weight, micro_steps=sources.weights.window_micro_steps,
                            hyper_digest=self.hyper_digest())
        self._apply_agreement(exchange(sources.comm, mine, sources.sync_device()), grads)

    def check_local(self) -> None:
        """What this rank checks alone before the agreement: no stray writes, the trainable set."""
        self._check_trainable_set()
        self._check_no_stray_writes()

    def hyper_digest(self) -> float:
        """One number for the optimizer's hyperparameters and the plan (equal on every rank in step)."""
        return join.hyperparameter_digest(self.sources.optimizer()) + self.sources.plan_digest()

    def _apply_agreement(self, agreement, grads: list[torch.Tensor]) -> None:
        """What every rank concluded together: overflow, unused parameters, the divisor."""
        sources = self.sources
        trainable = sources.params.trainable
        self.found_inf = agreement.any_overflow
        no_data = agreement.weight <= 0
        self.unused = {id(p) for p, users in zip(trainable, agreement.ranks_using) if users == 0 or no_data} \
            - carried_grads.holding(sources.buckets())
        divisor = self._divisor() * sources.weights.divisor(
            agreement.weight, agreement.micro_steps, agreement.ranks_with_micro_steps, sources.comm.world_size)
        self.totals = (agreement.weight, agreement.micro_steps)
        if divisor != 1.0:
            for grad in grads:
                grad.div_(divisor)
            carried_grads.add_back(sources.buckets(), divisor)
        self.applied_divisor = divisor
        self.note_held(agreement.ranks_using, no_data)
        sources.step_state.move(Phase.REDUCED)
        if not self.stepping.rebuilds_optimizer and self.unused:
            with guard.engine_access():
                for param in (p for p in trainable if id(p) in self.unused):
                    param.grad = None  # as DDP leaves it: torch optimizers then skip it

    def note_held(self, ranks_using: list[int], no_data: bool = False) -> None:
        """[Note: a zero gradient is a gradient]
        torch steps a parameter whose ``.grad`` is a tensor, zeros included: after
        ``zero_grad(set_to_none=False)`` a parameter that got a gradient once and none in this
        step has a zero ``.grad``, and Adam's momentum (and weight decay) still move it (torch on
        one process, DDP(find_unused_parameters=True) and FSDP2 agree). Only a ``.grad`` of None
        is skipped. So each parameter that got a gradient on any rank in an agreed window is
        *held* from then on, until ``zero_grad(set_to_none=True)`` drops it; every window
        starts with the held ones marked used (``end``), so the agreement counts them as
        having a gradient, zero where nothing was added, and the step takes them. Held comes
        from the agreed flags only, so it is the same on every rank."""
        if no_data:
            return
        held = self.sources.params.held_flags
        for index, users in enumerate(ranks_using):
            if users:
                held[index] = 1

    def note_params_written(self) -> None:
        """The engine wrote parameter values: remember their version counters."""
        if self.sources.separate_master:
            self.param_versions = [p._version for p in self.sources.params.trainable]

    def _check_no_stray_writes(self) -> None:
        """With a separate fp32 master, a write into a parameter would be overwritten by the
        next step: refuse it instead of losing it."""
        params = self.sources.params
        if not self.sources.separate_master:
            return
        for param, version in zip(params.trainable, self.param_versions):
            if param._version != version:
                raise ConfigError(
                    f"parameter {params.name(param)} was modified in place after "
                    "shard(). With param_dtype or offload_optimizer the optimizer steps an fp32 "
                    "master copy and would overwrite the change. Write parameters through "
                    "model.load_state_dict(...) or `with model.summon_full_params(): ...`.")

    def _check_trainable_set(self) -> None:
        """The trainable set may grow between steps (stages/replan.py), not inside a window
        whose gradients reached the change."""
        changed = self.sources.changed_trainable()
        if changed:
            raise ConfigError(
                f"the trainable set changed inside a gradient accumulation window: {changed[:5]} "
                "got gradients (or were added with add_param_group) after the engine planned this "
                "window, so they would be stepped with unreduced gradients or not at all. Change "
                "requires_grad and call add_param_group between optimizer steps (after "
                "optimizer.step()/zero_grad(), before the next forward).")

    def grads(self) -> list[torch.Tensor]:
        """The window's reduced gradients (the slices this rank holds)."""
        return [b.grad_shard for b in self.sources.buckets() if not b.window_fresh and b.grad_shard is not None]

    def outside_optimizer(self) -> list[FlatBucket]:
        """The trainable buckets in no param group: kept by the step and ``optimizer.zero_grad()``
        (see [Note: a gradient the optimizer does not own] in carried_grads.py)."""
        grouped = {id(p) for group in self.sources.grouped_params() for p in group}
        return carried_grads.outside(self.sources.buckets(), grouped)

    def end(self, kept: Optional[list[FlatBucket]] = None) -> None:
        """The step consumed the gradients; the next backward starts from zero. ``kept``: the
        buckets whose gradients stay (default: those in no param group; ``[]``: none)."""
        sources = self.sources
        kept = self.outside_optimizer() if kept is None else kept
        self.unused = set()
        sources.params.used_flags[:] = sources.params.held_flags  # see [Note: a zero gradient is a gradient]
        sources.weights.end_window(*self.totals)
        self.totals, self.applied_divisor = (0.0, 0), 1.0
        kept_params = {id(p) for b in kept for p in b.params}
        guard.set_grad_sharded([p for p in sources.params.trainable if id(p) not in kept_params], False)
        for bucket in kept:
            carried_grads.carry(bucket)
        for bucket in (b for b in sources.buckets() if not any(b is k for k in kept)):
            bucket.carried = None
            bucket.window_fresh = True
            bucket.local_factor = 1.0
            bucket.close_pieces()
            if bucket.full_grad is not None and sources.keeps_full_grads:
                if self.gradient_path.adopts(bucket):
                    for param in bucket.params:
                        param.grad = None  # adopt_grad treats None as zero
                else:
                    bucket.full_grad.zero_()
        sources.step_state.end_window()

    def zero_grad(self, set_to_none: bool = True, by_user: bool = True, everything: bool = True) -> None:
        """End the window; with ``set_to_none`` also free the gradient storage (see [Note:
        gradients live from backward to zero_grad] in stages/gradients.py) and forget which
        parameters hold a gradient ([Note: a zero gradient is a gradient]); ``by_user``: the
        user's call (``model.join()`` ends a joined rank's window without it). ``everything``:
        ``model.zero_grad()``; else ``optimizer.zero_grad()``, which keeps the gradients of the
        buckets in no param group (carried_grads.py)."""
        self.in_backward.check_zero_grad()
        sources, params = self.sources, self.sources.params
        kept = [] if everything else self.outside_optimizer()
        if any(not b.window_fresh for b in kept) and sources.weights.window_micro_steps \
                and not sources.step_state.normalized:
            self.finish_gradient_sync()  # normalize what they keep (every rank zeroes, as it steps)
        keep_flags = bytearray(len(params.held_flags))
        for param in (p for b in kept for p in b.params):
            keep_flags[params.flag_of[id(param)]] = params.held_flags[params.flag_of[id(param)]]
        if by_user and set_to_none:
            params.held_flags[:] = keep_flags
        elif by_user:  # a window discarded without a step: its gradients are zeroed, not dropped
            params.held_flags[:] = bytes(a | b for a, b in zip(params.held_flags, params.used_flags))
        self.end(kept)
        for bucket in (b for b in sources.buckets() if not any(b is k for k in kept)):
            for param in bucket.params:
                param.grad = None
            if set_to_none:
                self.gradient_path.release(bucket)


def _any_nonfinite(grads: list[torch.Tensor]) -> bool:
    return any(bool((~torch.isfinite(grad)).any()) for grad in grads)
