"""Rank workers: a sharded model that the user drops frees what it held."""

from __future__ import annotations

import gc
import os
import weakref

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch, build_model, rank_world


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _train_and_drop(stage: int) -> weakref.ref:
    rank, world = rank_world()
    torch.manual_seed(0)
    net = build_model(dict(vocab=11, dim=7, hidden=[5, 3], buffer=False))
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=stage)
    ids, targets = batch(dict(vocab=11, per_rank_batch=2, seed=0), 0, 0, world)
    F.cross_entropy(model(ids[rank * 2:(rank + 1) * 2]), targets[rank * 2:(rank + 1) * 2]).backward()
    optimizer.step()
    engine = weakref.ref(model.engine)
    del model, optimizer, net
    gc.collect()
    return engine


def drop_models(stages: list[int], repeats: int) -> dict:
    """Shard, train a step and drop a model ``repeats`` times per stage: is each engine freed,
    and how many threads does the process hold before and after?"""
    _single_thread()
    # A dropped model's groups are destroyed when the next model is made, so the process holds
    # the last one's: the baseline is a model of the last stage (stage 3 has two: its own and the
    # Gloo side group of its checked collective order)
    _train_and_drop(stages[-1])
    before = _threads()
    alive = [stage for stage in stages for _ in range(repeats) if _train_and_drop(stage)() is not None]
    return {"engines_alive": alive, "threads_before": before, "threads_after": _threads()}
