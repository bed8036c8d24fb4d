"""Rank workers: the trainable set changes after ``shard()`` (tests/engine/test_trainable_set.py).

Each scenario trains the sharded model and an unwrapped reference on the global
batch (engine_cases' [Note: the reference]) with the same change made to both
between steps: unfreezing a block frozen at wrap, freezing one, or
``add_param_group`` with new hyperparameters. The parameters and the optimizer
state (torch's full format) are compared after further steps.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch, build_model, compare_to_reference, rank_world, rel_err

NEW_GROUP = {"lr": 5e-3, "weight_decay": 0.2, "betas": (0.8, 0.95)}


def _blocks_and_rest(net) -> tuple[list, list]:
    blocks = [p for n, p in net.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in net.named_parameters() if not n.startswith("blocks.")]
    return blocks, rest


def _optimizer(net, scenario: str) -> torch.optim.Optimizer:
    blocks, rest = _blocks_and_rest(net)
    if scenario == "add_group":      # the root's parameters train but are in no group yet
        return torch.optim.AdamW(blocks, lr=1e-2, weight_decay=0.05)
    if scenario == "unfreeze_new_group":  # the frozen block is in no group yet
        blocks = [p for p in blocks if p.requires_grad]
    return torch.optim.AdamW([{"params": blocks, "lr": 3e-3, "weight_decay": 0.05},
                              {"params": rest, "lr": 1e-2, "weight_decay": 0.0}], lr=1e-2)


def _change(net, optimizer, scenario: str) -> None:
    """The change made after ``change_at`` steps (identically to both models)."""
    middle = list(net.blocks[len(net.blocks) // 2].parameters())
    if scenario in ("unfreeze", "unfreeze_new_group"):
        for param in middle:
            param.requires_grad_(True)
    if scenario == "unfreeze_new_group":
        optimizer.add_param_group({"params": middle, **NEW_GROUP})
    if scenario == "freeze":
        for param in net.blocks[0].parameters():
            param.requires_grad_(False)
    if scenario == "add_group":
        optimizer.add_param_group({"params": _blocks_and_rest(net)[1], **NEW_GROUP})


def train_changing_trainable_set(spec: dict) -> dict:
    """spec: engine_cases' model spec + scenario, stage, steps, change_at, options."""
    _single_thread()
    rank, world = rank_world()
    scenario = spec["scenario"]
    torch.manual_seed(spec["seed"])
    net = build_model({**spec, "frozen": scenario.startswith("unfreeze")})
    ref = copy.deepcopy(net)
    model, optimizer = se.shard(net, _optimizer(net, scenario), stage=spec["stage"],
                                bucket_mb=spec.get("bucket_mb", 25.0), **spec.get("options", {}))
    ref_optimizer = _optimizer(ref, scenario)
    b = spec["per_rank_batch"]
    for step in range(spec["steps"]):
        if step == spec["change_at"]:
            _change(net, optimizer, scenario)
            _change(ref, ref_optimizer, scenario)
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        F.cross_entropy(ref(ids), targets).backward()
        for opt, module in ((optimizer, model), (ref_optimizer, ref)):
            opt.step()
            opt.zero_grad()
            module.zero_grad()  # parameters in no param group too, as a trainer does
    result = compare_to_reference(model, ref, [], [])
    result["state_errors"] = _state_errors(model.full_optimizer_state_dict(optimizer), ref_optimizer.state_dict())
    result["replans"] = [repr(cost) for cost in model.engine.replans]
    result["groups"] = [{k: v for k, v in g.items() if k != "params"} == {k: v for k, v in r.items() if k != "params"}
                        for g, r in zip(optimizer.param_groups, ref_optimizer.param_groups)]
    return result


def _state_errors(full: dict, expected: dict) -> dict:
    """Per (position, key): relative error of the optimizer state in torch's format."""
    errors = {}
    if sorted(full["state"]) != sorted(expected["state"]):
        return {"positions": f"{sorted(full['state'])} != {sorted(expected['state'])}"}
    for position, state in expected["state"].items():
        for key, value in state.items():
            errors[f"{position}.{key}"] = rel_err(torch.as_tensor(full["state"][position][key]),
                                                  torch.as_tensor(value))
    return errors


def change_inside_window(spec: dict) -> str:
    """Unfreezing between two micro-steps of one window is refused at the step: the
    second micro-step's gradient of the unfrozen block was never reduced."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model({**spec, "frozen": True})
    model, optimizer = se.shard(net, _optimizer(net, "unfreeze"), stage=spec["stage"])
    b = spec["per_rank_batch"]
    try:
        for micro in range(2):
            if micro == 1:
                for param in net.blocks[len(net.blocks) // 2].parameters():
                    param.requires_grad_(True)
            ids, targets = batch(spec, 0, micro, world)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        optimizer.step()
    except se.ConfigError as error:
        return f"ConfigError: {error}"
    return "ok"


def unfreeze_after_forward(spec: dict) -> dict:
    """Unfrozen between a forward and its backward: autograd recorded the block frozen, so
    it gets no gradient this step (as in torch) and trains from the next forward on."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model({**spec, "frozen": True})
    ref = copy.deepcopy(net)
    model, optimizer = se.shard(net, _optimizer(net, "unfreeze"), stage=spec["stage"])
    ref_optimizer = _optimizer(ref, "unfreeze")
    b = spec["per_rank_batch"]
    for step in range(3):
        ids, targets = batch(spec, step, 0, world)
        out, ref_out = model(ids[rank * b:(rank + 1) * b]), ref(ids)
        if step == 0:
            for m in (net, ref):
                for param in m.blocks[len(m.blocks) // 2].parameters():
                    param.requires_grad_(True)
        F.cross_entropy(out, targets[rank * b:(rank + 1) * b]).backward()
        F.cross_entropy(ref_out, targets).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return compare_to_reference(model, ref, [], [])


def add_param_group_on_rank0_only(spec: dict) -> str:
    """Ranks that change the trainable set differently fail at the step's agreement."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = se.shard(net, _optimizer(net, "add_group"), stage=spec["stage"])
    b = spec["per_rank_batch"]
    if rank == 0:
        optimizer.add_param_group({"params": _blocks_and_rest(net)[1], **NEW_GROUP})
    ids, targets = batch(spec, 0, 0, world)
    try:
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        optimizer.step()
    except se.CollectiveError as error:
        return f"CollectiveError: {error}"
    return "ok"
