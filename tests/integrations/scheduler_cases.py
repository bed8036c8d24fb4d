"""Rank workers: an LR scheduler built on the optimizer *before* ``shard()``.

The usual Hugging Face / DeepSpeed order is optimizer, scheduler, then wrap. The
sharded run and a one-process reference (same optimizer, same schedule, the
global batch) must step with the same learning rates and end with the same
parameters; the object ``shard()`` returns must be the user's own.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch, build_model, compare_to_reference, make_optimizer, rank_world


def make_scheduler(kind: str, optimizer: torch.optim.Optimizer):
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 2.0 * step))
    if kind == "hf_linear_warmup":
        from transformers import get_linear_schedule_with_warmup
        return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=5)
    raise ValueError(kind)


def scheduler_before_shard(spec: dict) -> dict:
    """Train ``spec["steps"]`` steps with the scheduler built before shard(); compare with one process."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    optimizer = make_optimizer(net, spec["optimizer"])
    scheduler = make_scheduler(spec["scheduler"], optimizer)
    model, stepped = se.shard(net, optimizer, stage=spec["stage"], **spec.get("options", {}))
    ref_optimizer = make_optimizer(ref, spec["optimizer"])
    ref_scheduler = make_scheduler(spec["scheduler"], ref_optimizer)
    b = spec["per_rank_batch"]
    lrs, ref_lrs, logged = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(spec["steps"]):
            ids, targets = batch(spec, step, 0, world)
            F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
            lrs.append([group["lr"] for group in stepped.param_groups])  # what this step used
            stepped.step()
            stepped.zero_grad()
            scheduler.step()
            logged.append(optimizer.param_groups[0]["lr"])  # a logger holding the original object
            F.cross_entropy(ref(ids), targets).backward()
            ref_lrs.append([group["lr"] for group in ref_optimizer.param_groups])
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            ref_scheduler.step()
    return {**compare_to_reference(model, ref, [], []),
            "same_object": stepped is optimizer, "lrs": lrs, "ref_lrs": ref_lrs, "logged": logged,
            "ref_logged": [lr[0] for lr in ref_lrs[1:]] + [ref_optimizer.param_groups[0]["lr"]],
            "scheduler_lr": scheduler.get_last_lr(), "ref_scheduler_lr": ref_scheduler.get_last_lr(),
            "order_warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}


def scheduler_resumed_from_checkpoint(spec: dict, directory: str) -> dict:
    """Steps, save (model, optimizer, scheduler), more steps; a fresh run loads and repeats them.

    The two continuations must agree exactly: the scheduler's state and the optimizer's
    param groups come back together.
    """
    _single_thread()
    rank, world = rank_world()
    b = spec["per_rank_batch"]

    def build():
        torch.manual_seed(spec["seed"])
        net = build_model(spec)
        optimizer = make_optimizer(net, spec["optimizer"])
        scheduler = make_scheduler(spec["scheduler"], optimizer)
        model, stepped = se.shard(net, optimizer, stage=spec["stage"])
        return model, stepped, scheduler

    def train(model, optimizer, scheduler, steps):
        for step in steps:
            ids, targets = batch(spec, step, 0, world)
            F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, range(2))
    path = f"{directory}/rank{rank}.pt"
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path)
    state = model.state_dict()
    train(model, optimizer, scheduler, range(2, 4))
    first = model.full_state_dict()
    model2, optimizer2, scheduler2 = build()
    saved = torch.load(path, weights_only=False)
    model2.load_state_dict(state)
    optimizer2.load_state_dict(saved["optimizer"])
    scheduler2.load_state_dict(saved["scheduler"])
    train(model2, optimizer2, scheduler2, range(2, 4))
    second = model2.full_state_dict()
    return {"equal": all(torch.equal(first[key], second[key]) for key in first),
            "lr": [g["lr"] for g in optimizer.param_groups], "lr2": [g["lr"] for g in optimizer2.param_groups]}
