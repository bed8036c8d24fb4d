"""The optimizer's side of a stage engine: wrapping it, each step's before and after, clipping.

:class:`OptimizerSteps` is the engine's collaborator for the optimizer. It reads
``rebuilds_optimizer`` (the optimizer steps owned slices at stages >= 1, and at
stage 0 fp32 masters) and hands the stepped parameters to the stage's
publication (publication.py: nothing, all-gather, or gather on use). See
[Note: the whole-tensor optimizer seam] in optim/rebuild.py for where an
optimizer that needs whole parameters plugs in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..flat import guard
from ..flat.bucket import FlatBucket
from ..optim.rebuild import check_shardable, repoint_over
from ..optim.sharded_optimizer import attach_optimizer
from ..step import join
from ..step.agreement import Announcement
from ..step.phase import Phase
from .clipping import clip_window

if TYPE_CHECKING:
    from .engine import StageEngine


class OptimizerSteps:
    """Wrap the optimizer; agree and normalize before its step, publish parameters after."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine
        self.pending_groups: list[list[nn.Parameter]] = []  # add_param_group'd, planned at the next forward

    @property
    def rebuilds_optimizer(self) -> bool:
        """Whether the optimizer is rebuilt over flat shards (else the user's steps ``param.grad``):
        always when optimizer states are sharded; at stage 0 only for fp32 masters."""
        return self.engine.spec.shards_optimizer or self.engine.separate_master

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        engine = self.engine
        engine.original_groups = [list(group["params"]) for group in optimizer.param_groups]
        if self.rebuilds_optimizer:
            check_shardable(optimizer, engine.config.allow_unknown_optimizer,
                            engine.config.whole_tensor_optimizers)
            pieces = [[piece.param for b in engine.buckets if b.group_index == index and b.master is not None
                       for piece in b.split_master()] for index in range(len(optimizer.param_groups))]
            optimizer = repoint_over(optimizer, pieces)
        engine.optimizer = optimizer
        attach_optimizer(optimizer, engine)
        return optimizer

    def add_param_group(self, params: list[nn.Parameter]) -> None:
        """The engine's side of ``optimizer.add_param_group``: a rebuilt optimizer gets the
        group's fragments when the next training forward plans them (stages/replan.py); the
        user's optimizer (stage 0) steps the parameters themselves, from now on."""
        if self.rebuilds_optimizer:
            self.pending_groups.append(params)
        else:
            self.engine.original_groups.append(params)

    def before_step(self) -> None:
        engine = self.engine
        window = engine.window
        join.announce(engine, Announcement.STEP)
        window.finish_gradient_sync()
        if not self.rebuilds_optimizer:
            with guard.engine_access():
                for param in (p for p in engine.params.trainable if id(p) in window.unused):
                    param.grad = None  # torch optimizers skip a parameter with no gradient
            return
        if engine.disk is None:  # the disk tier gives each bucket its gradients as it steps it
            for bucket in engine.stepped_buckets():
                self.give_piece_grads(bucket)

    def give_piece_grads(self, bucket: FlatBucket) -> None:
        """Point the bucket's optimizer pieces at its reduced gradient, in the master's dtype and
        device; None on a skipped step, and for parameters without a gradient in this window."""
        window = self.engine.window
        skip = self.engine.scaler is not None and window.found_inf
        unused = frozenset(i for i, p in enumerate(bucket.params) if id(p) in window.unused)
        bucket.set_piece_grads(None if skip else bucket.master_grad(), unused)

    def attach_tier_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The disk tier steps bucket by bucket (offload/disk_tier.py); the other tiers step as torch does."""
        if self.engine.disk is not None:
            self.engine.disk.attach(optimizer)

    def after_step(self) -> None:
        engine = self.engine
        engine.counters.steps += 1
        if self.rebuilds_optimizer:
            skipped = engine.scaler is not None and engine.window.found_inf
            if not skipped:
                stepped = engine.stepped_buckets()
                if engine.disk is None:  # the disk tier copied each bucket as it stepped it
                    for bucket in stepped:
                        bucket.copy_master_to_params()
                engine.publication.after_step(stepped)
                engine.window.note_params_written()
            if engine.scaler is not None:
                engine.scaler.update(skipped)
                engine.window.found_inf = False
        engine.window.end()

    def broadcast_replicas(self, src: int) -> None:
        """Stage 0 after ``model.join()``: rank ``src``'s parameters and optimizer state for all."""
        engine = self.engine
        for bucket in engine.buckets:
            engine.comm.broadcast(bucket.full_param, src=src, label="join")
            if engine.separate_master and bucket.master is not None:
                engine.comm.broadcast(bucket.master, src=src, label="join")
        if engine.optimizer is not None:
            params = [p for group in engine.optimizer.param_groups for p in group["params"]]
            for param in params:
                state = engine.optimizer.state.get(param, {})
                for key in sorted(state):
                    if torch.is_tensor(state[key]):
                        engine.comm.broadcast(state[key], src=src, label="join")
        engine.window.note_params_written()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        engine = self.engine
        join.announce(engine, Announcement.CLIP, aux=(float(max_norm), float(norm_type)))
        engine.window.finish_gradient_sync()
        total = clip_window(engine.window.grads(), engine.comm, engine.spec.grads_replicated, max_norm,
                            norm_type, engine.forward.sync_device())
        engine.step_state.move(Phase.CLIPPED)
        return total
