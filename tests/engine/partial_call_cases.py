"""Rank workers: a collective call made on some ranks only.

``if rank == 0: torch.save(model.state_dict(), path)`` at stage 3 must fail on
every rank within seconds, naming the call, with a long collective timeout.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch, build_model, rank_world


def call_on_rank0_only(spec: dict, path: str) -> dict:
    """Train a step, make ``spec["call"]`` on rank 0 only, then train on: report the error and its delay."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = build_model(dict(vocab=11, dim=7, hidden=[5, 3], buffer=False))
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=spec["stage"],
                                timeout_s=spec["timeout_s"], **spec.get("options", {}))
    b = 3

    def step(index: int) -> None:
        ids, targets = batch(dict(vocab=11, per_rank_batch=b, seed=0), index, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    started = time.monotonic()
    try:
        if rank == 0:
            if spec["call"] == "state_dict":
                torch.save(model.state_dict(), path)
            elif spec["call"] == "summon":
                with model.summon_full_params():
                    pass
            elif spec["call"] == "full_optimizer_state_dict":
                model.full_optimizer_state_dict(optimizer)
        for index in range(1, 3):
            step(index)
    except se.CollectiveError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def call_on_every_rank(spec: dict, path: str) -> dict:
    """The right idioms: state_dict on every rank; full_state_dict(rank0_only=True) on every rank."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = build_model(dict(vocab=11, dim=7, hidden=[5, 3], buffer=False))
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=spec["stage"],
                                **spec.get("options", {}))
    states = []
    for index in range(3):
        ids, targets = batch(dict(vocab=11, per_rank_batch=3, seed=0), index, 0, world)
        F.cross_entropy(model(ids[rank * 3:(rank + 1) * 3]), targets[rank * 3:(rank + 1) * 3]).backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append(model.state_dict())
        only = model.full_state_dict(rank0_only=True)
        if rank == 0:
            torch.save(only, path)
        with model.summon_full_params():
            pass
    return {"keys": sorted(states[-1]), "equal_to_rank0_only": rank != 0 or all(
        torch.equal(states[-1][k], torch.load(path)[k]) for k in states[-1])}


def evaluate_on_rank0_only(spec: dict) -> dict:
    """Between steps rank 0 alone evaluates the model and reads a weight, then every rank trains on."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = build_model(dict(vocab=11, dim=7, hidden=[5, 3], buffer=False))
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=spec["stage"],
                                timeout_s=300.0, **spec.get("options", {}))
    ids, targets = batch(dict(vocab=11, per_rank_batch=3, seed=0), 0, 0, world)
    losses, alone, weight_sums = [], [], []
    for index in range(3):
        F.cross_entropy(model(ids[rank * 3:(rank + 1) * 3]), targets[rank * 3:(rank + 1) * 3]).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            losses.append(F.cross_entropy(model(ids), targets).item())  # every rank, the same batch
            if rank == 0:  # rank 0 alone, as `if rank == 0: evaluate(model)` does
                alone.append(F.cross_entropy(model(ids), targets).item())
            weight_sums.append(sum(p.double().sum().item() for p in model.parameters()))  # local reads
    return {"losses": losses, "alone": alone, "weight_sums": weight_sums}
