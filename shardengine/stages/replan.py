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

from ..errors import ConfigError
from ..flat import guard
from ..flat.bucket import FlatBucket
from ..memory import nbytes
from .weak_hook import weak_method_hook


def needs_replan(engine) -> bool:
    """Cheap, every training forward: did the trainable set grow since the plan?"""
    return bool(engine.stepping.pending_groups) or any(p.requires_grad for p in engine.params.frozen_at_wrap)


def plan_digest(engine) -> float:
    """A small number equal on ranks with the same plan (mixed into the step's agreement)."""
    grad_buckets = [b for b in engine.buckets if b.requires_grad]
    return float(sum(len(b.params) for b in grad_buckets)) + 0.5 * len(grad_buckets) \
        + 0.25 * len(engine.original_groups)


def replan_if_grown(engine) -> None:
    """Before a training forward (forward.py): grow the plan if the trainable set grew and
    no gradient of this window was made yet."""
    if needs_replan(engine) and window_is_empty(engine):
        replan(engine)


def changed_inside_window(engine) -> list[str]:
    """At the window's end (window.py): the changes of the trainable set its gradients reached."""
    return unreduced_change(engine) if needs_replan(engine) else []


def replan(engine) -> None:
    """Grow the buckets and the optimizer to the current trainable set (see the module note)."""
    started = time.perf_counter()
    _check_can_replan(engine)
    groups_added = _take_pending_groups(engine)
    group_of = {id(p): index for index, params in enumerate(engine.original_groups) for p in params}
    newly = [p for p in engine.params.frozen_at_wrap if p.requires_grad]
    grown = engine.layout.grow_plan(newly, group_of)  # stage 0-2: new buckets; stage 3: in place
    relabelled = _relabel_groupless(engine, group_of)
    for bucket in grown:
        engine.grads.give_buffers(bucket)  # what the stage keeps per trainable bucket
    for bucket in grown + relabelled:
        _join_optimizer(engine, bucket)
    engine.reindex()
    # Every parameter of a grown bucket gets the hook, frozen ones too: one unfrozen later
    # is then reduced like the others (as at wrap, see stages/engine.py _register_hooks).
    hooked = [p for b in grown for p in b.params]
    on_grad = weak_method_hook(engine.backward.on_param_grad)
    engine.handles += [p.register_post_accumulate_grad_hook(on_grad) for p in hooked]
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
            and all(b.window_fresh or b.carried is not None for b in engine.buckets))  # carried_grads.py


def unreduced_change(engine) -> list[str]:
    """At the step: parameters of a not-yet-planned change that this window's gradients
    reached. A parameter unfrozen after its forward got no gradient (autograd recorded it
    frozen), so it is exactly skipped and planned at the next forward; one that has a
    gradient, or a bucketed parameter waiting for its new param group, would be stepped
    wrongly."""
    with guard.engine_access():
        graded = [p for p in engine.params.frozen_at_wrap if p.requires_grad and p.grad is not None]
    if not window_is_empty(engine):
        bucketed = {id(p) for p in engine.params.trainable}
        graded += [p for group in engine.stepping.pending_groups for p in group if id(p) in bucketed]
    return [engine.params.name(p) for p in graded]



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
    pending, engine.stepping.pending_groups = engine.stepping.pending_groups, []
    for params in pending:
        engine.original_groups.append(params)
    return len(pending)


# ---------------------------------------------------------------------- growing buckets


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
            names = [engine.params.name(p) for p in bucket.params]
            raise ConfigError(
                f"parameters {names[:6]} share one flat buffer (they were trainable but in no "
                "optimizer param group at shard()), and add_param_group() now splits them between "
                f"param groups {sorted(g for g in groups if g is not None)} and none. Add all of them "
                "in one add_param_group() call, or give them their groups before shard()")
        bucket.group_index = groups.pop()
        relabelled.append(bucket)
    return relabelled


def _join_optimizer(engine, bucket: FlatBucket) -> None:
    """The bucket's fragments join their param group (fresh state, as torch starts it)."""
    if not engine.stepping.rebuilds_optimizer or bucket.master is None or bucket.group_index is None:
        return
    group = engine.optimizer.param_groups[bucket.group_index]
    group["params"].extend(engine.stepping.split_pieces(bucket))


def _training_bytes(bucket: FlatBucket) -> int:
    grads = nbytes(bucket.full_grad) if bucket.full_grad is not None else 0
    grads += nbytes(bucket.grad_shard) if bucket.grad_shard is not None else 0
    master = nbytes(bucket.master) if bucket.master is not None and bucket.master_is_separate else 0
    return grads + master
