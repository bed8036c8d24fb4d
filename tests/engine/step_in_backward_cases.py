"""Rank workers for the optimizer step inside backward (see test_step_in_backward.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, _uses_extra, batch
from rank_pool import rank_world
from toy_models import build_model, make_optimizer


def _rows(spec: dict, rank: int) -> slice:
    """This rank's rows of the global batch; ``uneven``: rank r drops r rows (batch weights)."""
    b = spec["per_rank_batch"]
    drop = rank if spec.get("uneven") else 0
    return slice(rank * b, (rank + 1) * b - drop)


def _shard(net, spec: dict, **extra):
    optimizer = make_optimizer(net, spec["optimizer"], groups="blocks")
    model, optimizer = se.shard(net, optimizer, stage=spec["stage"], bucket_mb=spec["bucket_mb"],
                                **spec.get("options", {}), **extra)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def train_with_and_without(spec: dict) -> dict:
    """The same model trained with and without ``step_in_backward`` side by side (an LR
    scheduler on both), with what the engine holds of gradients during and after backward."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    twin = copy.deepcopy(net)
    plain, plain_opt, plain_sched = _shard(net, spec)
    inside, inside_opt, inside_sched = _shard(twin, spec, step_in_backward=True)
    engine = inside.engine
    held_on_landing: list[int] = []
    landed = engine.in_backward.landed

    def sampling_landed(bucket):
        held_on_landing.append(engine.grads.held_bytes())  # this bucket's slice and any deferred
        landed(bucket)
    engine.in_backward.landed = sampling_landed
    hooks_ran, grads_after_backward, grad_attrs = [], [], []
    inside_opt.register_step_post_hook(lambda *_: hooks_ran.append(True))
    for step in range(spec["steps"]):
        ids, targets = batch(spec, step, 0, world)
        mine = _rows(spec, rank)
        for model, optimizer, scheduler in ((plain, plain_opt, plain_sched), (inside, inside_opt, inside_sched)):
            out = model(ids[mine], use_extra=_uses_extra(spec, step, rank))
            F.cross_entropy(out, targets[mine]).backward()
            if model is inside:
                grads_after_backward.append(model.memory_report().grads)
                grad_attrs.append(all(p.grad is None for p in model.parameters()))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    a, b = plain.full_state_dict(), inside.full_state_dict()
    shard_bytes = [b_.layout.shard_numel * torch.empty(0, dtype=b_.grad_dtype).element_size()
                   for b_ in engine.buckets if b_.requires_grad]
    return {
        "max_diff": max((a[k].double() - b[k].double()).abs().max().item() for k in a),
        "states_equal": all(torch.equal(a[k], b[k]) for k in a),
        "steps": (plain.steps_taken, inside.steps_taken),
        "hooks_ran": len(hooks_ran),
        "held_on_landing": held_on_landing,
        "grads_after_backward": grads_after_backward,
        "grad_attrs_none": grad_attrs,
        "shard_bytes": shard_bytes,
        "state": b,
    }


def misuse_in_training(case: str) -> str:
    """One call that conflicts with ``step_in_backward`` inside a training loop; its message."""
    _single_thread()
    rank, world = rank_world()
    spec = dict(seed=0, vocab=7, dim=5, hidden=[3], per_rank_batch=2, optimizer="adam", stage=2)
    torch.manual_seed(0)
    net = build_model(spec)
    model, optimizer = se.shard(net, make_optimizer(net, "adam"), stage=2, step_in_backward=True)
    ids, targets = batch(spec, 0, 0, world)

    def backward():
        F.cross_entropy(model(ids[:2]), targets[:2]).backward()
    try:
        if case == "clip":
            backward()
            model.clip_grad_norm_(1.0)
        elif case == "no_sync":
            with model.no_sync():
                backward()
        elif case == "join":
            with model.join():
                backward()
        elif case == "second_backward":
            backward()
            backward()
        elif case == "zero_grad_before_step":
            backward()
            optimizer.zero_grad()
    except se.ConfigError as error:
        return str(error)
    return ""


def train_in_small_runs(spec: dict) -> dict:
    """:func:`train_with_and_without` with the in-backward step's cap at ``spec["run_bytes"]``,
    so that every bucket is stepped in several runs of its pieces (optim/step_groups.py)."""
    from shardengine.optim import step_groups

    saved = step_groups.STEP_GROUP_BYTES
    step_groups.STEP_GROUP_BYTES = spec["run_bytes"]
    try:
        return train_with_and_without(spec)
    finally:
        step_groups.STEP_GROUP_BYTES = saved
