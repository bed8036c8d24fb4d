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
                                bucket_mb=spec["bucket_mb"], param_dtype=spec["param_dtype"])
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
