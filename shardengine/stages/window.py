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

from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from ..flat import guard
from ..step import join
from ..step.agreement import Announcement, Contribution, exchange
from ..step.phase import Phase
from . import replan

if TYPE_CHECKING:
    from .engine import StageEngine


class GradientWindow:
    """Normalization of the window's gradients, and the checks made once per window."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine
        self.applied_divisor = 1.0       # what the window's gradients were divided by
        self.found_inf = False           # fp16: the window's agreement saw an overflow
        self.unused: set[int] = set()    # ids of params that got no gradient on any rank
        self.totals: tuple[float, int] = (0.0, 0)  # the agreed window weight and micro-steps
        self.param_versions: list[int] = []  # with a separate master: the engine's last writes

    def reopen(self) -> None:
        """A backward in a window already normalized (stage 0 after a synchronizing backward,
        or after the step's agreement): take the division back, so accumulation stays linear."""
        engine = self.engine
        if not engine.step_state.normalized or all(b.window_fresh for b in engine.buckets):
            return
        if engine.step_state.window is Phase.CLIPPED:
            raise RuntimeError("a backward pass after clip_grad_norm_() in the same accumulation "
                               "window; call the optimizer step (or zero_grad) before the next backward")
        if self.applied_divisor != 1.0:
            for grad in self.grads():
                grad.mul_(self.applied_divisor)
        self.applied_divisor = 1.0

    def _divisor(self) -> float:
        """What stored gradients must still be divided by (see [Note: gradient windows]): the
        fp16 loss scale, and the rank count where reductions kept the sum."""
        engine = self.engine
        scale = engine.scaler.scale if engine.scaler is not None else 1.0
        return scale if engine.spec.divides_on_landing else scale * engine.world

    def finish_gradient_sync(self) -> None:
        """Wait for reductions in flight, agree with the other ranks (step/agreement.py) and
        normalize the window's gradients once."""
        engine = self.engine
        engine.failure.check_usable()
        if engine.step_state.in_backward:
            raise RuntimeError("the optimizer step (or clip_grad_norm_) was called during backward")
        engine.calls.check(engine, "an optimizer step (or clip_grad_norm_)")
        engine.reducer.wait_all()
        if engine.step_state.normalized:
            return
        self.check_local()
        grads = self.grads()
        overflow = engine.scaler is not None and _any_nonfinite(grads)
        mine = Contribution(engine.counters, engine.params.used_flags, Announcement.SYNC,
                            active=not engine.join_state.serving, overflow=overflow,
                            weight=engine.weights.window_weight, micro_steps=engine.weights.window_micro_steps,
                            hyper_digest=self.hyper_digest())
        self._apply_agreement(exchange(engine.comm, mine, engine.forward.sync_device()), grads)

    def check_local(self) -> None:
        """What this rank checks alone before the agreement: no stray writes, the trainable set."""
        self._check_trainable_set()
        self._check_no_stray_writes()

    def hyper_digest(self) -> float:
        """One number for the optimizer's hyperparameters and the plan (equal on every rank in step)."""
        engine = self.engine
        return join.hyperparameter_digest(engine.optimizer) + replan.plan_digest(engine)

    def _apply_agreement(self, agreement, grads: list[torch.Tensor]) -> None:
        """What every rank concluded together: overflow, unused parameters, the divisor."""
        engine = self.engine
        trainable = engine.params.trainable
        self.found_inf = agreement.any_overflow
        no_data = agreement.weight <= 0
        self.unused = {id(p) for p, users in zip(trainable, agreement.ranks_using) if users == 0 or no_data}
        divisor = self._divisor() * engine.weights.divisor(
            agreement.weight, agreement.micro_steps, agreement.ranks_with_micro_steps, engine.world)
        self.totals = (agreement.weight, agreement.micro_steps)
        if divisor != 1.0:
            for grad in grads:
                grad.div_(divisor)
        self.applied_divisor = divisor
        self.note_held(agreement.ranks_using, no_data)
        engine.step_state.move(Phase.REDUCED)
        if not engine.stepping.rebuilds_optimizer and self.unused:
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
        held = self.engine.params.held_flags
        for index, users in enumerate(ranks_using):
            if users:
                held[index] = 1

    def note_params_written(self) -> None:
        """The engine wrote parameter values: remember their version counters."""
        if self.engine.separate_master:
            self.param_versions = [p._version for p in self.engine.params.trainable]

    def _check_no_stray_writes(self) -> None:
        """With a separate fp32 master, a write into a parameter would be overwritten by the
        next step: refuse it instead of losing it."""
        engine = self.engine
        if not engine.separate_master:
            return
        for param, version in zip(engine.params.trainable, self.param_versions):
            if param._version != version:
                raise ConfigError(
                    f"parameter {engine.params.name(param)} was modified in place after "
                    "shard(). With param_dtype or offload_optimizer the optimizer steps an fp32 "
                    "master copy and would overwrite the change. Write parameters through "
                    "model.load_state_dict(...) or `with model.summon_full_params(): ...`.")

    def _check_trainable_set(self) -> None:
        """The trainable set may grow between steps (stages/replan.py), not inside a window
        whose gradients reached the change."""
        engine = self.engine
        changed = replan.unreduced_change(engine) if replan.needs_replan(engine) else []
        if changed:
            raise ConfigError(
                f"the trainable set changed inside a gradient accumulation window: {changed[:5]} "
                "got gradients (or were added with add_param_group) after the engine planned this "
                "window, so they would be stepped with unreduced gradients or not at all. Change "
                "requires_grad and call add_param_group between optimizer steps (after "
                "optimizer.step()/zero_grad(), before the next forward).")

    def grads(self) -> list[torch.Tensor]:
        """The window's reduced gradients (the slices this rank holds)."""
        return [b.grad_shard for b in self.engine.buckets if not b.window_fresh and b.grad_shard is not None]

    def end(self) -> None:
        """The step consumed the gradients; the next backward starts from zero."""
        engine = self.engine
        self.unused = set()
        engine.params.used_flags[:] = engine.params.held_flags  # see [Note: a zero gradient is a gradient]
        engine.weights.end_window(*self.totals)
        self.totals, self.applied_divisor = (0.0, 0), 1.0
        guard.set_grad_sharded(engine.params.trainable, False)
        for bucket in engine.buckets:
            bucket.window_fresh = True
            bucket.local_factor = 1.0
            bucket.set_piece_grads(None)
            if bucket.full_grad is not None and engine.spec.keeps_full_grads:
                if engine.grads.adopts(bucket):
                    for param in bucket.params:
                        param.grad = None  # adopt_grad treats None as zero
                else:
                    bucket.full_grad.zero_()
        engine.step_state.end_window()

    def zero_grad(self, set_to_none: bool = True, by_user: bool = True) -> None:
        """End the window; with ``set_to_none`` also free the gradient storage (see [Note:
        gradients live from backward to zero_grad] in stages/gradients.py) and forget which
        parameters hold a gradient ([Note: a zero gradient is a gradient]); ``by_user``: the
        user's call (``model.join()`` ends a joined rank's window without it)."""
        self.engine.in_backward.check_zero_grad()
        params = self.engine.params
        if by_user and set_to_none:
            params.held_flags[:] = bytes(len(params.held_flags))
        elif by_user:  # a window discarded without a step: its gradients are zeroed, not dropped
            params.held_flags[:] = bytes(a | b for a, b in zip(params.held_flags, params.used_flags))
        self.end()
        for bucket in self.engine.buckets:
            for param in bucket.params:
                param.grad = None
            if set_to_none:
                self.engine.grads.release(bucket)


def _any_nonfinite(grads: list[torch.Tensor]) -> bool:
    return any(bool((~torch.isfinite(grad)).any()) for grad in grads)
