"""The optimizer's side of a stage engine: wrapping it, each step's before and after, clipping.

A mixin of :class:`~shardengine.stages.base.DataParallel`. Stages differ here
only in ``rebuilds_optimizer`` (the optimizer steps owned slices, stages >= 1)
and ``_sync_params_after_step`` (stage 1-2 all-gather the stepped slices;
stage 3 keeps slices). See [Note: the whole-tensor optimizer seam] in
optim/rebuild.py for where an optimizer that needs whole parameters plugs in.
"""

from __future__ import annotations

import torch

from ..flat import guard
from ..flat.bucket import FlatBucket
from ..optim.rebuild import check_shardable, repoint_over
from ..optim.sharded_optimizer import attach_optimizer
from ..step import join
from ..step.agreement import Announcement
from ..step.phase import Phase
from .clipping import clip_window
from .devices import device_of


class OptimizerSteps:
    """Wrap the optimizer; agree and normalize before its step, publish parameters after."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.original_groups = [list(group["params"]) for group in optimizer.param_groups]
        if self.rebuilds_optimizer:
            check_shardable(optimizer, self.config.allow_unknown_optimizer,
                            self.config.whole_tensor_optimizers)
            pieces = [[piece.param for b in self.buckets if b.group_index == index and b.master is not None
                       for piece in b.split_master()] for index in range(len(optimizer.param_groups))]
            optimizer = repoint_over(optimizer, pieces)
        self.optimizer = optimizer
        attach_optimizer(optimizer, self)
        return optimizer

    def _stepped_buckets(self) -> list[FlatBucket]:
        return [b for b in self.buckets if b.master is not None]

    def before_step(self) -> None:
        join.announce(self, Announcement.STEP)
        self.finish_gradient_sync()
        if not self.rebuilds_optimizer:
            with guard.engine_access():
                for param in (p for p in self._trainable if id(p) in self._unused):
                    param.grad = None  # torch optimizers skip a parameter with no gradient
            return
        skip = self.scaler is not None and self._found_inf
        for bucket in self._stepped_buckets():
            unused = frozenset(i for i, p in enumerate(bucket.params) if id(p) in self._unused)
            bucket.set_piece_grads(None if skip else bucket.master_grad(), unused)

    def after_step(self) -> None:
        self.counters.steps += 1
        if self.rebuilds_optimizer:
            skipped = self.scaler is not None and self._found_inf
            if not skipped:
                for bucket in self._stepped_buckets():
                    bucket.copy_master_to_params()
                self._sync_params_after_step()
                self.note_params_written()
            if self.scaler is not None:
                self.scaler.update(skipped)
                self._found_inf = False
        self._end_grad_window()

    def _sync_params_after_step(self) -> None:
        pass  # stage 0: every rank stepped everything

    def broadcast_replicas(self, src: int) -> None:
        """Stage 0 after ``model.join()``: rank ``src``'s parameters and optimizer state for all."""
        for bucket in self.buckets:
            self.comm.broadcast(bucket.full_param, src=src, label="join")
            if self.separate_master and bucket.master is not None:
                self.comm.broadcast(bucket.master, src=src, label="join")
        if self.optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            for param in params:
                state = self.optimizer.state.get(param, {})
                for key in sorted(state):
                    if torch.is_tensor(state[key]):
                        self.comm.broadcast(state[key], src=src, label="join")
        self.note_params_written()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        join.announce(self, Announcement.CLIP, aux=(float(max_norm), float(norm_type)))
        self.finish_gradient_sync()
        total = clip_window(self._window_grads(), self.comm, self.grads_replicated, max_norm, norm_type,
                            device_of(self.module, allow_meta=True))
        self.step_state.move(Phase.CLIPPED)
        return total
