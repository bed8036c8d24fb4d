"""The optimizer's side of a stage engine: wrapping it, each step's before and after, clipping.

:class:`OptimizerSteps` is the engine's collaborator for the optimizer. It reads
``rebuilds_optimizer`` (the optimizer steps owned slices at stages >= 1, and at
stage 0 fp32 masters) and hands the stepped parameters to the stage's
publication (publication.py: nothing, all-gather, or gather on use). See
[Note: the whole-tensor optimizer seam] in optim/rebuild.py for where an
optimizer that needs whole parameters plugs in.

It is built from :class:`StepSources` (the stage's facts as data, the step's
state, the collaborators it calls) and ``connect``ed to the two made after it:
the step inside backward (in_backward.py), which steps through it, and the
publication.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from ..distributed.hybrid import HybridCommunicator
from ..flat import guard
from ..flat.bucket import Buckets
from ..offload.disk_tier import DiskTier
from ..optim import bucketed_step, step_groups
from ..optim.rebuild import check_shardable, repoint_over
from ..optim.whole_tensor import inner_optimizers
from ..step.agreement import Announcement, ProgressCounters
from ..step.mixed_precision import DynamicLossScaler
from ..step.phase import Phase, StepState
from .clipping import clip_window
from .in_backward import refuse
from .params import ParamIndex
from .publication import Publication


class Window(Protocol):
    """What the optimizer's steps ask of the gradient window (window.py)."""

    found_inf: bool      # fp16: the window's agreement saw an overflow
    unused: set[int]     # ids of the parameters no rank used in this window

    def finish_gradient_sync(self) -> None: ...

    def grads(self) -> list[torch.Tensor]: ...

    def note_params_written(self) -> None: ...

    def end(self) -> None: ...


class InBackward(Protocol):
    """What they ask of the step inside backward (in_backward.py)."""

    def check_optimizer(self, members: list, bucketed: list) -> None: ...

    def user_step(self) -> None: ...


@dataclass(frozen=True)
class StepSources:
    """What the optimizer's steps use. ``buckets``, ``stepped_buckets`` and ``optimizer`` are
    read at each call: the plan grows (replan.py) and the optimizer is wrapped after this."""

    shards_optimizer: bool             # StageSpec: the optimizer steps this rank's slices
    separate_master: bool              # an fp32 master apart from the parameters (engine.separate_master)
    grads_replicated: bool             # StageSpec: every rank holds the full gradients (clipping)
    step_in_backward: bool             # ``step_in_backward=True``: the step ran inside backward
    allow_unknown_optimizer: bool      # ShardConfig: shard an optimizer class not known to be element-wise
    whole_tensor_optimizers: tuple     # ShardConfig: further classes that need whole parameters
    comm: HybridCommunicator
    buckets: Buckets                   # every bucket of the plan
    stepped_buckets: Buckets           # those with a master
    original_groups: list              # the engine's list of the user's param groups, filled in place
    optimizer: Callable[[], Optional[torch.optim.Optimizer]]  # the wrapped one (None before the wrap)
    adopt: Callable[[torch.optim.Optimizer], None]  # the engine keeps it and hooks it (optim/sharded_optimizer.py)
    announce: Callable[..., None]      # join.announce for this engine (a no-op outside join())
    counters: ProgressCounters
    step_state: StepState
    scaler: Optional[DynamicLossScaler]  # fp16 loss scaling
    params: ParamIndex
    window: Window
    disk: Optional[DiskTier]           # the optimizer's files (offload/disk_tier.py)
    sync_device: Callable[[], torch.device]  # where the clip's norm lives (forward.py)


class OptimizerSteps:
    """Wrap the optimizer; agree and normalize before its step, publish parameters after."""

    def __init__(self, sources: StepSources):
        self.sources = sources
        self.in_backward: Optional[InBackward] = None   # connect()
        self.publication: Optional[Publication] = None  # connect()
        self.pending_groups: list[list[nn.Parameter]] = []  # add_param_group'd, planned at the next forward
        self.bucketed: list[torch.optim.Optimizer] = []  # the members that step bucket by bucket

    def connect(self, in_backward: InBackward, publication: Publication) -> None:
        """The partners made after this: the step inside backward (which steps through this)
        and the publication of the stepped parameters."""
        self.in_backward, self.publication = in_backward, publication

    @property
    def rebuilds_optimizer(self) -> bool:
        """Whether the optimizer is rebuilt over flat shards (else the user's steps ``param.grad``):
        always when optimizer states are sharded; at stage 0 only for fp32 masters."""
        return self.sources.shards_optimizer or self.sources.separate_master

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        sources = self.sources
        sources.original_groups[:] = [list(group["params"]) for group in optimizer.param_groups]
        if self.rebuilds_optimizer:
            check_shardable(optimizer, sources.allow_unknown_optimizer, sources.whole_tensor_optimizers)
            pieces = [[param for b in sources.buckets() if b.group_index == index and b.master is not None
                       for param in self.split_pieces(b)] for index in range(len(optimizer.param_groups))]
            optimizer = repoint_over(optimizer, pieces)
            self._bound_steps(optimizer)
        sources.adopt(optimizer)
        return optimizer

    def split_pieces(self, bucket) -> list[nn.Parameter]:
        """The bucket's optimizer tensors (flat/bucket.py ``split_master``), their gradients guarded
        outside the step (see [Note: the optimizer's pieces outside the step] in flat/guard.py)."""
        name, replicated = self.sources.params.name, self.sources.grads_replicated
        pieces = bucket.split_master()
        for piece in pieces:
            span = "" if replicated else f"[{piece.param_start}:{piece.param_end}]"
            guard.attach_piece(piece.param, f"{name(bucket.params[piece.slot])!r}{span}", replicated)
        return [piece.param for piece in pieces]

    def _bound_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Each member that may step bucket by bucket does so over its own param groups."""
        self.bucketed = [member for member in inner_optimizers(optimizer)
                         if bucketed_step.steps_bucket_by_bucket(member)]
        for member in self.bucketed:
            bucketed_step.install(member, functools.partial(self._step_buckets, member))
        self.in_backward.check_optimizer(inner_optimizers(optimizer), self.bucketed)

    def _group_ranges(self) -> list[tuple[torch.optim.Optimizer, range]]:
        """Each member with the indices of its param groups in the optimizer's list (read at
        each step: ``add_param_group`` grows a single optimizer's)."""
        ranges, first = [], 0
        for member in inner_optimizers(self.sources.optimizer()):
            ranges.append((member, range(first, first + len(member.param_groups))))
            first += len(member.param_groups)
        return ranges

    @property
    def bucketed_groups(self) -> frozenset[int]:
        """Param groups stepped bucket by bucket: their gradients are handed in ``_step_buckets``."""
        return frozenset(index for member, groups in self._group_ranges()
                         if any(member is m for m in self.bucketed) for index in groups)

    def _step_buckets(self, member: torch.optim.Optimizer, run_step: Callable[[], None]) -> None:
        """Step ``member``'s buckets one at a time, each bucket's gradients handed just before
        and dropped just after (an fp16 overflow skips them all, as it skips the step)."""
        sources = self.sources
        if sources.step_in_backward or self._overflowed():
            return  # stepped inside backward already (stages/in_backward.py), or an fp16 overflow
        groups = next(groups for inner, groups in self._group_ranges() if inner is member)
        buckets = [b for b in sources.stepped_buckets() if b.group_index in groups]
        disk = sources.disk  # reads each bucket in ahead and writes it behind (offload/disk_tier.py)
        for bucket in buckets if disk is None else disk.each_bucket(buckets):
            self._step_bucket(member, groups, bucket, run_step)

    def _step_bucket(self, member: torch.optim.Optimizer, groups: range, bucket, run_step: Callable[[], None]) -> None:
        """Run ``member``'s step over ``bucket``'s pieces alone, with their gradients handed."""
        if self._hand_grads(bucket):
            pieces = [piece.param for piece in bucket.master_pieces]
            with bucketed_step.only_params(member, bucket.group_index - groups.start, pieces):
                run_step()
        bucket.set_piece_grads(None)

    def step_bucket_now(self, bucket) -> None:
        """``step_in_backward``: step ``bucket`` where its gradient landed (stages/in_backward.py),
        one capped run of its pieces at a time (optim/step_groups.py)."""
        member, groups = next((m, g) for m, g in self._group_ranges() if bucket.group_index in g)
        run_step = bucketed_step.unhooked_step(member)
        unused = self._unused_slots(bucket)
        pieces = bucket.master_pieces
        numels = [piece.master_end - piece.master_start for piece in pieces]
        for run in step_groups.step_runs(numels, bucket.master.element_size()):
            with guard.grads_open([pieces[i].param for i in run]):
                handed = bucket.hand_run_grads([pieces[i] for i in run], unused)
                if handed:
                    with bucketed_step.only_params(member, bucket.group_index - groups.start, handed):
                        run_step()
                for param in handed:
                    param.grad = None

    def add_param_group(self, params: list[nn.Parameter]) -> None:
        """The engine's side of ``optimizer.add_param_group``: a rebuilt optimizer gets the
        group's fragments when the next training forward plans them (stages/replan.py); the
        user's optimizer (stage 0) steps the parameters themselves, from now on."""
        if self.rebuilds_optimizer:
            self.pending_groups.append(params)
        else:
            self.sources.original_groups.append(params)

    def _overflowed(self) -> bool:
        """fp16: the window saw an overflow, so this step is skipped (and the scale backs off)."""
        return self.sources.scaler is not None and self.sources.window.found_inf

    def before_step(self) -> None:
        sources = self.sources
        if sources.step_in_backward:
            self.in_backward.user_step()  # the step ran inside backward: only the hooks are left
            return
        window = sources.window
        sources.announce(Announcement.STEP)
        window.finish_gradient_sync()
        if not self.rebuilds_optimizer:
            with guard.engine_access():
                for param in (p for p in sources.params.trainable if id(p) in window.unused):
                    param.grad = None  # torch optimizers skip a parameter with no gradient
            return
        skip = self._overflowed()
        bucketed = self.bucketed_groups  # handed bucket by bucket inside the step
        for bucket in sources.stepped_buckets():
            # the step reads them: open until the window ends (window.py ``end``)
            guard.set_grad_sharded([piece.param for piece in bucket.master_pieces], False)
            if skip:
                bucket.set_piece_grads(None)
            elif bucket.group_index not in bucketed:
                self._hand_grads(bucket)

    def close_pieces(self) -> None:
        """After a step that raised: its pieces' gradients are dropped and guarded again, as the
        window's end does after a step (a retried step hands them again)."""
        for bucket in self.sources.stepped_buckets():
            bucket.close_pieces()

    def _hand_grads(self, bucket) -> bool:
        """Point the bucket's optimizer pieces at its master gradient; False if it has none."""
        unused = self._unused_slots(bucket)
        grad = bucket.master_grad()
        bucket.set_piece_grads(grad, unused)
        return grad is not None

    def _unused_slots(self, bucket) -> frozenset[int]:
        """The bucket's parameters no rank used in this window: not stepped (torch skips them)."""
        return frozenset(i for i, p in enumerate(bucket.params) if id(p) in self.sources.window.unused)

    def attach_tier_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The disk tier needs every member stepped bucket by bucket (offload/disk_tier.py)."""
        if self.sources.disk is not None:
            self.sources.disk.attach(optimizer, self.bucketed)

    def after_step(self) -> None:
        sources = self.sources
        if sources.step_in_backward:
            return  # counted, published and ended where it ran, at the end of backward
        sources.counters.steps += 1
        if self.rebuilds_optimizer:
            skipped = self._overflowed()
            if not skipped:
                self.publish_stepped()
            if sources.scaler is not None:
                sources.scaler.update(skipped)
                sources.window.found_inf = False
        sources.window.end()

    def publish_stepped(self) -> None:
        """The stepped masters reach the compute parameters, and every rank (publication.py)."""
        stepped = self.sources.stepped_buckets()
        if self.sources.disk is None:  # the disk tier copied each bucket as it stepped it
            for bucket in stepped:
                bucket.copy_master_to_params()
        self.publication.after_step(stepped)
        self.sources.window.note_params_written()

    def broadcast_replicas(self, src: int) -> None:
        """Stage 0 after ``model.join()``: rank ``src``'s parameters and optimizer state for all."""
        sources, comm = self.sources, self.sources.comm
        for bucket in sources.buckets():
            comm.broadcast(bucket.full_param, src=src, label="join")
            if sources.separate_master and bucket.master is not None:
                comm.broadcast(bucket.master, src=src, label="join")
        optimizer = sources.optimizer()
        if optimizer is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for param in params:
                state = optimizer.state.get(param, {})
                for key in sorted(state):
                    if torch.is_tensor(state[key]):
                        comm.broadcast(state[key], src=src, label="join")
        sources.window.note_params_written()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        sources = self.sources
        if sources.step_in_backward:
            raise refuse("clip_grad_norm_() (global-norm clipping needs every gradient before any step)",
                         "Drop step_in_backward to clip by the global norm.")
        sources.announce(Announcement.CLIP, aux=(float(max_norm), float(norm_type)))
        sources.window.finish_gradient_sync()
        total = clip_window(sources.window.grads(), sources.comm, sources.grads_replicated, max_norm,
                            norm_type, sources.sync_device())
        sources.step_state.move(Phase.CLIPPED)
        return total
