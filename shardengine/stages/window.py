"""A gradient window's end: wait, agree with the other ranks, normalize once; and its reset.

A mixin of :class:`~shardengine.stages.base.DataParallel`; see [Note: gradient
windows] in stages/base.py and [Note: the step's phases] in step/phase.py. Stages
differ only in ``divides_on_landing`` (stage 1 keeps reduced sums until the
step) and ``keeps_full_grads`` (stages 0-1 keep a persistent full gradient to zero).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..flat import guard
from ..flat.bucket import FlatBucket
from ..step import join
from ..step.agreement import Announcement, Contribution, exchange
from ..step.phase import Phase
from . import replan


class GradientWindow:
    """Normalization of the window's gradients, and the checks made once per window."""

    def _reopen_window(self) -> None:
        """A backward in a window already normalized (stage 0 after a synchronizing backward,
        or after the step's agreement): take the division back, so accumulation stays linear."""
        if not self.step_state.normalized or all(b.window_fresh for b in self.buckets):
            return
        if self.step_state.window is Phase.CLIPPED:
            raise RuntimeError("a backward pass after clip_grad_norm_() in the same accumulation "
                               "window; call the optimizer step (or zero_grad) before the next backward")
        if self._applied_divisor != 1.0:
            for grad in self._window_grads():
                grad.mul_(self._applied_divisor)
        self._applied_divisor = 1.0

    def _mark_reduced(self, bucket: FlatBucket) -> None:
        bucket.window_fresh = False

    def _window_divisor(self) -> float:
        """What stored gradients must still be divided by (see [Note: gradient windows]): the
        fp16 loss scale, and the rank count where reductions kept the sum."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return scale if self.divides_on_landing else scale * self.world

    def finish_gradient_sync(self) -> None:
        """Wait for reductions in flight, agree with the other ranks (step/agreement.py) and
        normalize the window's gradients once."""
        self.check_usable()
        if self.step_state.in_backward:
            raise RuntimeError("the optimizer step (or clip_grad_norm_) was called during backward")
        self.calls.check(self, "an optimizer step (or clip_grad_norm_)")
        self.reducer.wait_all()
        if self.step_state.normalized:
            return
        self._check_trainable_set()
        self._check_no_stray_writes()
        grads = self._window_grads()
        overflow = self.scaler is not None and _any_nonfinite(grads)
        mine = Contribution(self.counters, self._used_flags, Announcement.SYNC, active=not self.join_state.serving,
                            overflow=overflow, weight=self.weights.window_weight,
                            micro_steps=self.weights.window_micro_steps,
                            hyper_digest=join.hyperparameter_digest(self.optimizer) + replan.plan_digest(self))
        self._apply_agreement(exchange(self.comm, mine, self.sync_device()), grads)

    def _apply_agreement(self, agreement, grads: list[torch.Tensor]) -> None:
        """What every rank concluded together: overflow, unused parameters, the divisor."""
        self._found_inf = agreement.any_overflow
        no_data = agreement.weight <= 0
        self._unused = {id(p) for p, users in zip(self._trainable, agreement.ranks_using)
                        if users == 0 or no_data}
        divisor = self._window_divisor() * self.weights.divisor(
            agreement.weight, agreement.micro_steps, agreement.ranks_with_micro_steps, self.world)
        self._window_totals = (agreement.weight, agreement.micro_steps)
        if divisor != 1.0:
            for grad in grads:
                grad.div_(divisor)
        self._applied_divisor = divisor
        self.step_state.move(Phase.REDUCED)
        if not self.rebuilds_optimizer and self._unused:
            with guard.engine_access():
                for param in (p for p in self._trainable if id(p) in self._unused):
                    param.grad = None  # as DDP leaves it: torch optimizers then skip it

    def note_params_written(self) -> None:
        """The engine wrote parameter values: remember their version counters."""
        if self.separate_master:
            self._param_versions = [p._version for p in self._trainable]

    def _check_no_stray_writes(self) -> None:
        """With a separate fp32 master, a write into a parameter would be overwritten by the
        next step: refuse it instead of losing it."""
        if not self.separate_master:
            return
        for param, version in zip(self._trainable, self._param_versions):
            if param._version != version:
                raise ConfigError(
                    f"parameter {self._name_of.get(id(param), '?')} was modified in place after "
                    "shard(). With param_dtype or offload_optimizer the optimizer steps an fp32 "
                    "master copy and would overwrite the change. Write parameters through "
                    "model.load_state_dict(...) or `with model.summon_full_params(): ...`.")

    def _check_trainable_set(self) -> None:
        """The trainable set may grow between steps (stages/replan.py), not inside a window
        whose gradients reached the change."""
        changed = replan.unreduced_change(self) if replan.needs_replan(self) else []
        if changed:
            raise ConfigError(
                f"the trainable set changed inside a gradient accumulation window: {changed[:5]} "
                "got gradients (or were added with add_param_group) after the engine planned this "
                "window, so they would be stepped with unreduced gradients or not at all. Change "
                "requires_grad and call add_param_group between optimizer steps (after "
                "optimizer.step()/zero_grad(), before the next forward).")

    def _window_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets if not b.window_fresh and b.grad_shard is not None]

    def _end_grad_window(self) -> None:
        """The step consumed the gradients; the next backward starts from zero."""
        self._unused = set()
        self._used_flags[:] = bytes(len(self._used_flags))
        self.weights.end_window(*getattr(self, "_window_totals", (0.0, 0)))
        self._window_totals, self._applied_divisor = (0.0, 0), 1.0
        guard.set_grad_sharded(self._trainable, False)
        for bucket in self.buckets:
            bucket.window_fresh = True
            bucket.local_factor = 1.0
            bucket.set_piece_grads(None)
            if bucket.full_grad is not None and self.keeps_full_grads:
                if self._adopts_grads(bucket):
                    for param in bucket.params:
                        param.grad = None  # adopt_grad treats None as zero
                else:
                    bucket.full_grad.zero_()
        self.step_state.end_window()

    def zero_grad(self) -> None:
        self._end_grad_window()
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None


def _any_nonfinite(grads: list[torch.Tensor]) -> bool:
    return any(bool((~torch.isfinite(grad)).any()) for grad in grads)
