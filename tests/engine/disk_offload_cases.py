"""Rank workers for the disk tier (``offload_optimizer="disk"``): training, reports, checkpoints.

Every run trains the same small model with Adam, two micro-batches per step (the
first under ``no_sync()``) and gradient clipping; the disk run must end with the
very bits of the same run with the optimizer in memory.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

import shardengine as se
from toy_models import Net

VOCAB, STEPS, MICRO = 17, 3, 2


def _net() -> Net:
    torch.manual_seed(0)
    return Net(VOCAB, 12, [12, 12], residual=True, buffer=False)


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()) / MICRO


def _train(model, optimizer, steps: int = STEPS, seed: int = 1) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batches = torch.randint(0, VOCAB, (MICRO, world, 3, 5), generator=generator)
        with model.no_sync():
            _loss(model, batches[0][rank]).backward()
        _loss(model, batches[1][rank]).backward()
        model.clip_grad_norm_(0.05)  # small enough to clip every step
        optimizer.step()
        optimizer.zero_grad()


def _shard(stage: int, options: dict):
    net = _net()
    return se.shard(net, torch.optim.Adam(net.parameters(), lr=0.05), stage=stage, bucket_mb=0.001,
                    **options)


def trained_weights(stage: int, options: dict) -> dict[str, torch.Tensor]:
    model, optimizer = _shard(stage, options)
    _train(model, optimizer)
    return model.full_state_dict()


def disk_matches_memory(stage: int, path: str, precision: dict) -> list[str]:
    """Names of the tensors whose bits differ between the disk tier and the in-memory runs."""
    disk = trained_weights(stage, {"offload_optimizer": "disk", "offload_path": path, **precision})
    differ = []
    for memory in ({}, {"offload_optimizer": True}):
        reference = trained_weights(stage, {**memory, **precision})
        differ += [k for k in reference if not torch.equal(reference[k], disk[k])]
    return differ


def tier_bytes(stage: int, path: str) -> dict:
    """memory_report() of a disk run after its steps, with the files' true sizes and the counts
    the report must equal. Each rank has a directory of its own: the files another rank is
    making at that moment (each exists from its creation to its unlinking) are not this rank's."""
    path = os.path.join(path, f"rank{se.distributed.rank()}")
    os.makedirs(path, exist_ok=True)
    model, optimizer = _shard(stage, {"offload_optimizer": "disk", "offload_path": path,
                                      "param_dtype": "bf16"})
    before = model.memory_report()
    _train(model, optimizer, steps=1)
    report = model.memory_report()
    buckets = model.engine.stepped_buckets()
    shard = sum(b.master.numel() for b in buckets)  # with the padding, which has no optimizer state
    stepped = sum(piece.param.numel() for b in buckets for piece in b.master_pieces)
    files = [f for f in os.listdir(path) if f.startswith("shardengine-disk")]
    return {"before": before.as_dict(), "after": report.as_dict(), "shard": shard, "stepped": stepped,
            "files_left": files}


def _resumed(stage: int, before: dict, after: dict, checkpoint: str) -> dict[str, torch.Tensor]:
    """Train 2 steps, save, load into a fresh run with ``after`` (its own ``stage`` if given),
    train 1 more step: the weights."""
    model, optimizer = _shard(stage, before)
    _train(model, optimizer, steps=2)
    se.save_checkpoint(checkpoint, model, optimizer)
    after = dict(after)
    resumed, resumed_optimizer = _shard(after.pop("stage", stage), after)
    se.load_checkpoint(checkpoint, resumed, resumed_optimizer)
    _train(resumed, resumed_optimizer, steps=1, seed=2)
    return resumed.full_state_dict()


def checkpoint_round_trip(stage: int, path: str, checkpoint: str, after: dict) -> list[str]:
    """Saved from the disk tier and resumed with ``after`` (another tier, stage or world size)
    against the same run saved from memory and resumed in memory."""
    got = _resumed(stage, {"offload_optimizer": "disk", "offload_path": path}, after, checkpoint + "-disk")
    want = _resumed(stage, {}, {k: v for k, v in after.items() if k == "stage"}, checkpoint + "-memory")
    return [k for k in want if not torch.equal(want[k], got[k])]


def optimizer_state_round_trip(path: str) -> list[str]:
    """optimizer.state_dict() reads the state out of the files (the same values as in memory);
    load_state_dict() copies what it is given into files, leaving the caller's tensors alone."""
    model, optimizer = _shard(2, {"offload_optimizer": "disk", "offload_path": path})
    reference, reference_optimizer = _shard(2, {"offload_optimizer": True})
    _train(model, optimizer, steps=1)
    _train(reference, reference_optimizer, steps=1)
    saved, expected = optimizer.state_dict(), reference_optimizer.state_dict()
    problems = [f"{i}.{k}" for i, s in expected["state"].items() for k, v in s.items()
                if not torch.equal(v, saved["state"][i][k])]
    given = copy.deepcopy(saved)
    optimizer.load_state_dict(given)
    kept = copy.deepcopy(given)
    _train(model, optimizer, steps=1)
    _train(reference, reference_optimizer, steps=1)
    # (torch itself keeps the caller's "step" tensors; the moments are copied into files)
    problems += [f"{i} changed by training" for i, s in kept["state"].items()
                 if any(v.dim() > 0 and not torch.equal(v, given["state"][i][k]) for k, v in s.items())]
    if not all(model.engine.disk.files.holds(v) for s in optimizer.state.values() for v in s.values()
               if v.dim() > 0):
        problems.append("state left in memory after load_state_dict")
    got, want = model.full_state_dict(), reference.full_state_dict()
    return problems + [k for k in want if not torch.equal(want[k], got[k])]



def muon_disk_matches_memory(stage: int, path: str, params: bool = False) -> list[str]:
    """A whole-tensor optimizer (Muon steps each whole matrix): the disk tier's narrowed groups
    change nothing for it either; ``params``: with stage 3's parameter shards on disk too."""
    runs = []
    disk = {"offload_params" if params else "offload_optimizer": "disk", "offload_path": path}
    for offload in (disk, {"offload_optimizer": True}):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 6, bias=False))
        model, optimizer = se.shard(net, torch.optim.Muon(net.parameters(), lr=0.02), stage=stage,
                                    bucket_mb=0.0001, **offload)
        generator = torch.Generator().manual_seed(torch.distributed.get_rank())
        for _ in range(STEPS):
            model(torch.randn(4, 6, generator=generator)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append(model.full_state_dict())
    return [k for k in runs[1] if not torch.equal(runs[0][k], runs[1][k])]


def replan_disk_matches_memory(stage: int, path: str) -> list[str]:
    """A block frozen at shard() and unfrozen after a step (the plan grows, stages/replan.py):
    its new master goes into a file too, and the run stays equal to the one in memory."""
    runs = []
    for offload in ({"offload_optimizer": "disk", "offload_path": path}, {"offload_optimizer": True}):
        net = _net()
        net.blocks[1].requires_grad_(False)
        model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=0.05), stage=stage,
                                    bucket_mb=0.001, **offload)
        _train(model, optimizer, steps=1)
        net.blocks[1].requires_grad_(True)
        _train(model, optimizer, steps=2, seed=2)
        if model.engine.disk is not None and not all(model.engine.disk.files.holds(b.master)
                                                      for b in model.engine.stepped_buckets()):
            return ["a master grown after shard() is not in a file"]
        runs.append(model.full_state_dict())
    return [k for k in runs[1] if not torch.equal(runs[0][k], runs[1][k])]


def per_rank_directories(stage: int, path: str, options: dict) -> list[str]:
    """Each rank's files in a directory of its own (``path/rank<r>``): names of the tensors whose
    bits differ from the run in memory, and any file of one rank left in another's directory."""
    rank = torch.distributed.get_rank()
    mine = os.path.join(path, f"rank{rank}")
    os.makedirs(mine, exist_ok=True)
    disk = trained_weights(stage, {**options, "offload_path": mine})
    reference = trained_weights(stage, {})
    return [k for k in reference if not torch.equal(reference[k], disk[k])] + os.listdir(mine)
