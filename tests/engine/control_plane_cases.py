"""Rank workers: what the engine sends to the rendezvous store, and how fast a stopped peer is noticed.

The store is counted by wrapping the default group's store in a
:class:`~shardengine.distributed.store_trace.RecordingStore` before ``shard()``: the
engine's keys and its groups' backend rendezvous (``new_group`` builds each group's
store over the default one) all go through it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch, build_model, rank_world
from shardengine.distributed.store_trace import RecordingStore

NET = dict(vocab=11, dim=7, hidden=[5, 3], buffer=False)
B = 3
NOTICE_BOUND_S = 3.0  # one 0.5 s slice and a store round trip, with room for a loaded 2-core machine


@contextlib.contextmanager
def recording_default_store() -> Iterator[RecordingStore]:
    """Every request to the default group's store, and to the stores of groups made meanwhile."""
    world = dist.distributed_c10d._world
    group = dist.distributed_c10d._get_default_group()
    backend, store = world.pg_map[group]
    recording = RecordingStore(store)
    world.pg_map[group] = (backend, recording)
    try:
        yield recording
    finally:
        world.pg_map[group] = (backend, store)


def _shard(stage: int, **options):
    torch.manual_seed(0)
    net = build_model(NET)
    return se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=stage, timeout_s=300.0, **options)


def _step(model, optimizer, index: int, micro_steps: int = 1) -> None:
    """A training step as a user writes it: forward, backward (accumulated), clip, step, zero_grad."""
    rank, world = rank_world()
    for micro in range(micro_steps):
        ids, targets = batch(dict(vocab=11, per_rank_batch=B, seed=0), index, micro, world)
        sync = contextlib.nullcontext() if micro == micro_steps - 1 else model.no_sync()
        with sync:
            F.cross_entropy(model(ids[rank * B:(rank + 1) * B]), targets[rank * B:(rank + 1) * B]).backward()
    model.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()


def count_store_requests(configs: list[dict]) -> list[dict]:
    """Per config: the store requests of its training steps (after a first one), of an eval
    forward, and of one announced call (``state_dict()``) if it is collective there."""
    _single_thread()
    found = []
    for config in configs:
        options = config.get("options", {})
        with recording_default_store() as store:
            model, optimizer = _shard(config["stage"], **options)
            _step(model, optimizer, 0)
            start = store.mark("steps")
            for index in (1, 2):
                _step(model, optimizer, index, micro_steps=config.get("micro_steps", 1))
            with torch.no_grad():
                model(torch.zeros(2, 4, dtype=torch.long))
            steps = store.since(start)
            start = store.mark("state_dict")
            model.state_dict()
            announced = store.since(start)
        found.append({"steps": [(r.op, r.key) for r in steps], "announced": [r.op for r in announced]})
        del model, optimizer
    return found


def stop_while_others_wait(spec: dict) -> dict:
    """Every rank trains a step; then the last rank stops (``engine.failure.fail``) a second into
    the next step, while the others wait in its collectives. When did each notice, and what?"""
    _single_thread()
    rank, world = rank_world()
    model, optimizer = _shard(spec["stage"])
    _step(model, optimizer, 0)
    if rank == world - 1:
        time.sleep(spec["delay_s"])
        stopped = time.time()
        try:
            model.engine.failure.fail("stopped on purpose for the test")
        except se.CollectiveError:
            pass
        return {"stopped_at": stopped}
    try:
        _step(model, optimizer, 1)
    except se.CollectiveError as error:
        return {"error": str(error), "noticed_at": time.time()}
    return {"error": None, "noticed_at": time.time()}


def host_wait_notices_a_stopped_peer(delay_s: float) -> dict:
    """``host_copy``'s wait (NCCL's path, driven here by a condition that never comes true) while
    rank 1 stops: rank 0 must raise at its next slice, not wait for ever."""
    _single_thread()
    rank, _ = rank_world()
    model, _ = _shard(1)
    world_comm = model.engine.comm.world
    if rank == 1:
        time.sleep(delay_s)
        stopped = time.time()
        world_comm.abort("rank 1 stopped on purpose for the test")
        return {"stopped_at": stopped}
    started = time.time()
    try:
        world_comm.wait_until(lambda: time.time() > started + 60)
    except RuntimeError as error:
        return {"error": str(error), "noticed_at": time.time()}
    return {"error": None, "noticed_at": time.time()}
