"""Rank workers for when stages 2-3 allocate a bucket's flat gradient (see test_reduction_buffers.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch
from rank_pool import rank_world
from shardengine.flat.bucket import FlatBucket
from shardengine.stages.gradients import TransientReduceScatter
from toy_models import build_model, make_optimizer


def _record_order(events: list) -> tuple:
    """Wraps the gradient path so that every stored gradient and every flat-buffer
    allocation is logged as (kind, bucket id) in the order they happen."""
    store, alloc = TransientReduceScatter.store, FlatBucket.alloc_unwritten_grad

    def logged_store(self, bucket, index, factor):
        events.append(("gradient", id(bucket)))
        return store(self, bucket, index, factor)

    def logged_alloc(self):
        if self.full_grad is None:
            events.append(("buffer", id(self)))
        return alloc(self)

    TransientReduceScatter.store, FlatBucket.alloc_unwritten_grad = logged_store, logged_alloc
    return store, alloc


def train(spec: dict) -> dict:
    """``spec["steps"]`` steps at ``spec["stage"]`` with ``spec["options"]``; the full state
    afterwards, and (stages 2-3) whether any bucket's flat gradient was allocated before the
    last of its gradients arrived."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                bucket_mb=spec["bucket_mb"], **spec["options"])
    events: list = []
    saved = _record_order(events) if spec["stage"] >= 2 else None
    b, early, buffers = spec["per_rank_batch"], 0, 0
    try:
        for step in range(spec["steps"]):
            events.clear()
            ids, targets = batch(spec, step, 0, world)
            F.cross_entropy(model(ids[rank * b:(rank + 1) * b]).float(), targets[rank * b:(rank + 1) * b]).backward()
            early += sum(_allocated_early(events, bucket) for kind, bucket in events if kind == "buffer")
            buffers += sum(kind == "buffer" for kind, _ in events)
            optimizer.step()
            optimizer.zero_grad()
    finally:
        if saved is not None:
            TransientReduceScatter.store, FlatBucket.alloc_unwritten_grad = saved
    return {"state": model.full_state_dict(), "buffers": buffers, "early": early}


def _allocated_early(events: list, bucket: int) -> bool:
    """In one backward: whether ``bucket``'s flat gradient was allocated before its last gradient."""
    allocated = events.index(("buffer", bucket))
    return ("gradient", bucket) in events[allocated + 1:]
