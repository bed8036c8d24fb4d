"""Rank workers for tests/engine/test_zero_grad.py: what ``zero_grad`` leaves of the gradients.

One worker trains the same model three times in one call (zeroed by
``optimizer.zero_grad()``, by ``model.zero_grad()``, and by
``optimizer.zero_grad(set_to_none=False)``), so a case costs one pool round trip.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch
from rank_pool import rank_world
from toy_models import build_model, make_optimizer

ZEROINGS = ("optimizer", "model", "keep")


def _zero(model, optimizer, how: str) -> None:
    if how == "optimizer":
        optimizer.zero_grad()           # torch's default: set_to_none=True
    elif how == "model":
        model.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=False)


def _train(spec: dict, how: str) -> dict:
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                bucket_mb=spec["bucket_mb"], **spec.get("options", {}))
    b = spec["per_rank_batch"]
    after_step, after_zero, held_after_zero = [], [], []
    for step in range(spec["steps"]):
        for micro in range(2):  # the first micro-step under no_sync: local gradients kept
            ids, targets = batch(spec, step, micro, world)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        optimizer.step()
        after_step.append(model.memory_report().grads)
        _zero(model, optimizer, how)
        after_zero.append(model.memory_report().grads)
        held_after_zero.append(sum(b.full_grad is not None or b.grad_shard is not None
                                   for b in model.engine.buckets))
    return {"after_step": after_step, "after_zero": after_zero, "held_after_zero": held_after_zero,
            "state": model.full_state_dict()}


def zero_grad_runs(spec: dict) -> dict:
    """The three ways of zeroing, each over ``spec['steps']`` steps (see the module docstring)."""
    _single_thread()
    return {how: _train(spec, how) for how in ZEROINGS}
