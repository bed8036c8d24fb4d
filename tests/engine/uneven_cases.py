"""Rank workers for uneven data: different batch sizes per rank, and ranks that stop early.

Every rank trains on its own slice of each (step, micro-step) pool of samples,
with a loss that is a sum over its samples divided by ``max(n, 1)`` (so a rank
with no samples has loss 0) and by the micro-steps; the engine's batch weights
must make the update equal to single-process training on the union of the
samples actually seen, averaged per sample.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, compare_to_reference
from rank_pool import rank_world
from toy_models import build_model, make_optimizer


def pool(spec: dict, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's samples of (step, micro), concatenated in rank order."""
    total = sum(spec["sizes"][step][micro])
    gen = torch.Generator().manual_seed(1_000 * spec["seed"] + 31 * step + micro)
    return (torch.randint(0, spec["vocab"], (total,), generator=gen),
            torch.randint(0, spec["vocab"], (total,), generator=gen))


def rows_of(spec: dict, step: int, micro: int, rank: int) -> slice:
    sizes = spec["sizes"][step][micro]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def steps_of(spec: dict, rank: int) -> int:
    """How many steps ``rank`` runs (fewer than the others under join)."""
    return spec["steps"] - spec.get("fewer", [0] * (rank + 1))[rank]


def train_uneven(spec: dict) -> dict:
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"], groups="blocks"), stage=spec["stage"],
                                bucket_mb=spec.get("bucket_mb", 25.0), **spec.get("options", {}))
    norms = _train_ranks_share(spec, model, optimizer, rank)
    ref_norms = _train_reference(spec, ref, make_optimizer(ref, spec["optimizer"], groups="blocks"), world)
    return {**compare_to_reference(model, ref, norms, ref_norms[:len(norms)]),
            "counters": model.engine.counters.as_tuple()}


def _schedule(spec: dict, optimizer):
    """With ``schedule``: a learning rate that decays every step (a joined rank's stops moving)."""
    if not spec.get("schedule"):
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def _train_ranks_share(spec: dict, model, optimizer, rank: int) -> list[float]:
    micro_steps, norms = spec["micro_steps"], []
    scheduler = _schedule(spec, optimizer)
    for _ in range(spec.get("epochs", 1)):
        with model.join() if spec.get("join") else contextlib.nullcontext():
            for step in range(steps_of(spec, rank)):
                for micro in range(micro_steps):
                    ids, targets = pool(spec, step, micro)
                    mine = rows_of(spec, step, micro, rank)
                    n = mine.stop - mine.start
                    with contextlib.nullcontext() if micro == micro_steps - 1 else model.no_sync():
                        loss = F.cross_entropy(model(ids[mine]), targets[mine], reduction="sum") / max(n, 1)
                        (loss / micro_steps).backward()
                if spec.get("max_norm") is not None:
                    norms.append(float(model.clip_grad_norm_(spec["max_norm"])))
                optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
        while scheduler is not None and scheduler.last_epoch < model.steps_taken:
            scheduler.step()  # a rank that joined early catches up with the global step
    return norms


def _train_reference(spec: dict, ref, optimizer, world: int) -> list[float]:
    """One process, each step on the union of what the ranks still running saw."""
    norms, scheduler = [], _schedule(spec, optimizer)
    for index in range(spec.get("epochs", 1) * spec["steps"]):
        step = index % spec["steps"]
        if index and scheduler is not None:
            scheduler.step()
        running = [r for r in range(world) if step < steps_of(spec, r)]
        losses, count = [], 0
        for micro in range(spec["micro_steps"]):
            ids, targets = pool(spec, step, micro)
            for r in running:
                mine = rows_of(spec, step, micro, r)
                count += mine.stop - mine.start
                losses.append(F.cross_entropy(ref(ids[mine]), targets[mine], reduction="sum"))
        if count == 0:  # no data anywhere: nothing moves (the engine skips such a step)
            optimizer.zero_grad()
            norms.append(0.0)
            continue
        (sum(losses) / count).backward()
        if spec.get("max_norm") is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["max_norm"])))
        optimizer.step()
        optimizer.zero_grad()
    return norms



def raise_inside_join_on_rank1(stage: int) -> dict:
    """Rank 1 raises in its second step inside join(); rank 0 goes on and must not hang."""
    _single_thread()
    rank, _ = rank_world()
    torch.manual_seed(0)
    net = build_model(dict(vocab=7, dim=5, hidden=[3]))
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage)
    started = time.monotonic()
    try:
        with model.join():
            for step in range(3):
                if rank == 1 and step == 1:
                    raise ValueError("bad batch")
                model(torch.tensor([1, 2, 3])).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    except Exception as error:  # noqa: BLE001
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}
    return {"error": None}


def nested_join() -> str:
    net = build_model(dict(vocab=7, dim=5, hidden=[3]))
    model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        with model.join():
            with model.join():
                pass
    except RuntimeError as error:
        return str(error)
    return "no error"


def lr_differs_on_rank1(stage: int) -> dict:
    """Rank 1 changes its learning rate alone: the next step must fail on every rank."""
    _single_thread()
    rank, _ = rank_world()
    net = build_model(dict(vocab=7, dim=5, hidden=[3]))
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=0.1), stage=stage)
    if rank == 1:
        optimizer.param_groups[0]["lr"] = 0.05
    try:
        model(torch.tensor([1, 2, 3])).sum().backward()
        optimizer.step()
    except se.CollectiveError as error:
        return {"error": str(error)}
    return {"error": None}
