"""Rank workers for the optimizer step's working set (see test_step_memory.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch
from rank_pool import rank_world
from shardengine.testing.allocator_tracker import AllocatorTracker
from toy_models import build_model, make_optimizer


def _backward(model, spec: dict, step: int, rank: int, world: int) -> None:
    b = spec["per_rank_batch"]
    ids, targets = batch(spec, step, 0, world)
    F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()


def step_working_set(spec: dict) -> dict:
    """Bytes the second optimizer step allocates above what was alive when it began (the
    first step creates the optimizer state, which is not the step's working set), with the
    stepped buckets' shards and their largest optimizer piece."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model({**spec, "buffer": False})  # an fp32 buffer would meet bf16 activations
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                bucket_mb=spec["bucket_mb"], param_dtype=spec["param_dtype"],
                                reduce_dtype=spec.get("reduce_dtype"))
    _backward(model, spec, 0, rank, world)
    optimizer.step()
    optimizer.zero_grad()
    _backward(model, spec, 1, rank, world)
    with AllocatorTracker() as tracker:
        with tracker.phase("step"):
            optimizer.step()
    stepped = model.engine.stepped_buckets()
    return {
        "peak": tracker.peak_in("step") - tracker.live_at_start_of("step"),
        "shards": [b.layout.shard_numel if b.master.numel() < b.layout.padded_numel else b.master.numel()
                   for b in stepped],
        "largest_piece": [max((p.param.numel() for p in b.master_pieces), default=0) for b in stepped],
    }


def in_backward_step_working_set(spec: dict) -> dict:
    """With ``step_in_backward``: the most bytes one bucket's step inside the second backward
    allocates above what was alive when it began, with the largest bucket shard stepped."""
    from shardengine.optim import step_groups

    _single_thread()
    rank, world = rank_world()
    saved, step_groups.STEP_GROUP_BYTES = step_groups.STEP_GROUP_BYTES, spec["run_bytes"]
    torch.manual_seed(spec["seed"])
    net = build_model({**spec, "buffer": False})
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                bucket_mb=spec["bucket_mb"], param_dtype=spec["param_dtype"], step_in_backward=True)
    stepping, steps = model.engine.stepping, []
    step_now = stepping.step_bucket_now

    def tracked(bucket):
        steps.append(f"step {len(steps)}")
        with tracker.phase(steps[-1]):
            step_now(bucket)
    try:
        for step in range(2):  # the first creates the optimizer state
            steps.clear()
            with AllocatorTracker() as tracker:
                stepping.step_bucket_now = tracked
                _backward(model, spec, step, rank, world)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        step_groups.STEP_GROUP_BYTES = saved
    return {
        "peak": max(tracker.peak_in(name) - tracker.live_at_start_of(name) for name in steps),
        "largest_shard": max(b.master.numel() for b in model.engine.stepped_buckets()),
        "largest_piece": max(p.param.numel() for b in model.engine.stepped_buckets() for p in b.master_pieces),
    }
