"""The trainable set changes after ``shard()``: unfreezing and ``add_param_group``.

[Note: growing the plan in place]
``shard()`` packs the trainable parameters into flat buckets and builds the
optimizer over their owned fragments. Later a user may unfreeze a parameter
that was frozen at wrap (gradual unfreezing) or add a param group
(``ZeroRedundancyOptimizer.add_param_group``). The next training forward
(the first of a new accumulation window) grows the plan:

* stages 0-2: the newly trainable parameters (frozen at wrap, so held whole on
  every rank, outside any bucket) get buckets of their own, planned exactly as
  ``shard()`` plans them (by param group and dtype, size-capped);
* stage 3: a frozen parameter lives, sharded, in its unit's frozen bucket; that
  bucket becomes a gradient bucket in place (its still-frozen parameters then
  get no gradient and are skipped as torch skips them);
* a bucket of parameters that were trainable but in no param group takes the
  group ``add_param_group`` puts them in;
* the new fragments join their optimizer param group with fresh state, as
  torch's optimizer starts a parameter's state at its first step.

Existing buckets, their values and optimizer state are untouched, so nothing
moves between ranks: every rank derives the same new plan from the same
``requires_grad`` flags and param groups (the SPMD contract FSDP2 and
ZeroRedundancyOptimizer rely on too). The step's agreement (step/agreement.py)
then includes a digest of the plan, so ranks that changed the trainable set
differently fail with a clear error instead of stepping different models.

Freezing a trainable parameter needs no re-plan: it gets no gradient, and the
engine skips it at the step exactly as torch skips a parameter whose ``grad``
is None; its bucket and optimizer state stay, so unfreezing it again resumes
its state as torch would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
import torch
from torch import nn

from ..errors import ConfigError
from ..flat import guard
from ..flat.bucket import FlatBucket
from ..flat.layout import split_into_buckets
from ..memory import nbytes
from .weak_hook import weak_method_hook


def needs_replan(engine) -> bool:
    """Cheap, every training forward: did the trainable set grow since the plan?"""
    return bool(engine.pending_groups) or any(p.requires_grad for p in engine._frozen_at_wrap)


def plan_digest(engine) -> float:
    """A small number equal on ranks with the same plan (mixed into the step's agreement)."""
    grad_buckets = [b for b in engine.buckets if b.requires_grad]
    return float(sum(len(b.params) for b in grad_buckets)) + 0.5 * len(grad_buckets) \
        + 0.25 * len(engine.original_groups)


def replan(engine) -> None:
    """Grow the buckets and the optimizer to the current trainable set (see the module note)."""
    started = time.perf_counter()
    _check_can_replan(engine)
    groups_added = _take_pending_groups(engine)
    group_of = {id(p): index for index, params in enumerate(engine.original_groups) for p in params}
    newly = [p for p in engine._frozen_at_wrap if p.requires_grad]
    grown = engine._grow_plan(newly, group_of)  # stage 0-2: new buckets; stage 3: in place
    relabelled = _relabel_groupless(engine, group_of)
    for bucket in grown:
        _give_training_buffers(engine, bucket)
    for bucket in grown + relabelled:
        _join_optimizer(engine, bucket)
    engine._index_params()
    # Every parameter of a grown bucket gets the hook, frozen ones too: one unfrozen later
    # is then reduced like the others (as at wrap, see stages/base.py _register_hooks).
    hooked = [p for b in grown for p in b.params]
    engine._handles += [p.register_post_accumulate_grad_hook(weak_method_hook(engine._on_param_grad))
                        for p in hooked]
    engine.replans.append(ReplanCost(
        seconds=time.perf_counter() - started, params=len(hooked), groups_added=groups_added,
        bytes_added=sum(_training_bytes(b) for b in grown)))


@dataclass(frozen=True)
class ReplanCost:
    """What one re-plan did and cost (``model.engine.replans``; docs/compile-and-trainable-set.md)."""

    seconds: float       # wall time of the re-plan on this rank
    params: int          # parameters of the buckets that started training
    groups_added: int    # param groups add_param_group'd since the last plan
    bytes_added: int     # gradient buffers and separate fp32 masters allocated

    def __repr__(self) -> str:
        return (f"ReplanCost(ms={self.seconds * 1e3:.2f}, params={self.params}, "
                f"groups_added={self.groups_added}, bytes_added={self.bytes_added})")


# ---------------------------------------------------------------------- checks


def window_is_empty(engine) -> bool:
    """No backward since the last step or zero_grad (under no_sync too)."""
    return (not engine.step_state.in_backward and engine.weights.window_micro_steps == 0
            and all(b.window_fresh for b in engine.buckets))


def unreduced_change(engine) -> list[str]:
    """At the step: parameters of a not-yet-planned change that this window's gradients
    reached. A parameter unfrozen after its forward got no gradient (autograd recorded it
    frozen), so it is exactly skipped and planned at the next forward; one that has a
    gradient, or a bucketed parameter waiting for its new param group, would be stepped
    wrongly."""
    with guard.engine_access():
        graded = [p for p in engine._frozen_at_wrap if p.requires_grad and p.grad is not None]
    if not window_is_empty(engine):
        bucketed = {id(p) for p in engine._trainable}
        graded += [p for group in engine.pending_groups for p in group if id(p) in bucketed]
    return [engine._name_of.get(id(p), "?") for p in graded]



def _check_can_replan(engine) -> None:
    if not window_is_empty(engine):
        raise ConfigError(
            "the trainable set changed (requires_grad or add_param_group) inside a gradient "
            "accumulation window, after a backward whose gradients are not yet stepped; change it "
            "between optimizer steps (after optimizer.step()/zero_grad(), before the next forward)")
    if engine.compression is not None:
        raise ConfigError("changing the trainable set after shard() is not supported with gradient or "
                          "parameter compression (its state is planned per bucket); set requires_grad "
                          "and the param groups before shard()")


def _take_pending_groups(engine) -> int:
    pending, engine.pending_groups = engine.pending_groups, []
    for params in pending:
        engine.original_groups.append(params)
    return len(pending)


# ---------------------------------------------------------------------- growing buckets


def new_replicated_buckets(engine, params: list[nn.Parameter], group_of: dict[int, int]) -> list[FlatBucket]:
    """Stages 0-2: buckets for parameters frozen at wrap (whole on every rank, in the
    compute dtype), by (group, dtype), size-capped like shard()'s plan."""
    order = {id(p): i for i, p in enumerate(engine.module.parameters())}
    params = sorted(params, key=lambda p: -order[id(p)])  # reverse registration, as at wrap
    by_key: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        by_key.setdefault((group_of.get(id(param)), param.dtype), []).append(param)
    buckets = []
    device = engine.sync_device()
    for (group, _), same in by_key.items():
        elements = max(1, engine.config.bucket_bytes // same[0].element_size())
        for indices in split_into_buckets([p.numel() for p in same], elements):
            bucket = engine._new_bucket([same[i] for i in indices], group, device)
            if engine.rebuilds_optimizer:
                bucket.make_master(separate=engine.separate_master, device=engine.storage.master_device)
            bucket.grad_dtype = engine.grad_dtype or bucket.dtype
            engine.buckets.append(bucket)
            buckets.append(bucket)
    return buckets


def unfreeze_unit_buckets(engine, params: list[nn.Parameter]) -> list[FlatBucket]:
    """Stage 3: the frozen buckets holding newly trainable parameters train from now on
    (in the param group shard() gave them; see _relabel_groupless otherwise)."""
    wanted = {id(p) for p in params}
    grown = []
    for bucket in engine.buckets:
        if bucket.requires_grad or not any(id(p) in wanted for p in bucket.params):
            continue
        bucket.requires_grad = True
        if engine.rebuilds_optimizer:
            separate = engine.separate_master
            shard = bucket.param_shard.detach()
            if separate:
                device = engine.storage.master_device or shard.device
                shard = shard.to(device=device, dtype=torch.float32, copy=True)
            bucket.master, bucket.master_is_separate = shard, separate
        bucket.grad_dtype = engine.grad_dtype or bucket.dtype
        grown.append(bucket)
    return grown


def _relabel_groupless(engine, group_of: dict[int, int]) -> list[FlatBucket]:
    """Buckets in no param group whose parameters ``add_param_group`` has now placed."""
    relabelled = []
    for bucket in engine.buckets:
        if bucket.group_index is not None or not bucket.requires_grad:
            continue
        groups = {group_of.get(id(p)) for p in bucket.params}
        if groups == {None}:
            continue
        if len(groups) > 1:
            names = [engine._name_of.get(id(p), "?") for p in bucket.params]
            raise ConfigError(
                f"parameters {names[:6]} share one flat buffer (they were trainable but in no "
                "optimizer param group at shard()), and add_param_group() now splits them between "
                f"param groups {sorted(g for g in groups if g is not None)} and none. Add all of them "
                "in one add_param_group() call, or give them their groups before shard()")
        bucket.group_index = groups.pop()
        relabelled.append(bucket)
    return relabelled


def _give_training_buffers(engine, bucket: FlatBucket) -> None:
    """What the stage keeps per trainable bucket (see the stages' ``_prepare_grads``)."""
    if engine.keeps_full_grads:
        bucket.alloc_full_grad()
    elif bucket.grad_shard is None:
        bucket.grad_shard = torch.zeros(bucket.layout.shard_numel, dtype=bucket.grad_dtype,
                                        device=bucket.full_param.device)


def _join_optimizer(engine, bucket: FlatBucket) -> None:
    """The bucket's fragments join their param group (fresh state, as torch starts it)."""
    if not engine.rebuilds_optimizer or bucket.master is None or bucket.group_index is None:
        return
    pieces = bucket.split_master()
    group = engine.optimizer.param_groups[bucket.group_index]
    group["params"].extend(piece.param for piece in pieces)


def _training_bytes(bucket: FlatBucket) -> int:
    grads = nbytes(bucket.full_grad) if bucket.full_grad is not None else 0
    grads += nbytes(bucket.grad_shard) if bucket.grad_shard is not None else 0
    master = nbytes(bucket.master) if bucket.master is not None and bucket.master_is_separate else 0
    return grads + master
