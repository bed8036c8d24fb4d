"""Record what one real run sends to the rendezvous store, phase by phase (run under torchrun).

Used by ``bench_control_plane.py`` (``--record``): every rank joins the group on a
:class:`~shardengine.distributed.store_trace.RecordingStore` around the store torchrun's
environment names (``rendezvous("env://")``, what ``init_process_group()`` itself does),
so the backend's rendezvous, ``new_group`` and the engine's own keys are all seen. Then,
for each stage, it shards a tiny GPT and labels what follows: ``shard`` (the engine's
groups and wrap-time checks), three training steps (forward, backward,
``clip_grad_norm_``, ``step``, ``zero_grad``), each announced call, a checkpoint save and
load, and a ``stalled`` step in which rank 1 arrives 1.2 s late (the others' Gloo waits
poll the store for an abort). One JSON file per rank: ``trace_N<world>_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist

import shardengine as se
from shardengine.distributed.store_trace import RecordingStore
from shardengine.testing.models import build_gpt, example_inputs, lm_loss

STEPS = 3
LATE_S = 1.2  # rank 1's delay in the stalled step: more than two 0.5 s abort-poll slices


def train_step(model, optimizer, rank: int) -> None:
    idx, targets = example_inputs(2, 16, vocab_size=64, seed=rank)
    lm_loss(model(idx), targets).backward()
    model.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()


def one_stage(store: RecordingStore, stage: int, rank: int, folder: str, hybrid: int) -> None:
    tag = f"s{stage}" + (f"-k{hybrid}" if hybrid else "")
    store.mark(f"{tag}/shard")
    net = build_gpt("tiny", vocab_size=64, seq_len=16, seed=0)
    options = {"shard_group_size": hybrid} if hybrid else {}
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=stage,
                                timeout_s=120, **options)
    for _ in range(STEPS):
        store.mark(f"{tag}/step")
        train_step(model, optimizer, rank)
    store.mark(f"{tag}/state_dict")
    model.state_dict()
    store.mark(f"{tag}/full_state_dict")
    model.full_state_dict()
    store.mark(f"{tag}/summon_full_params")
    with model.summon_full_params():
        pass
    store.mark(f"{tag}/full_optimizer_state_dict")
    model.full_optimizer_state_dict(optimizer)
    store.mark(f"{tag}/save_checkpoint")
    path = se.save_checkpoint(os.path.join(folder, tag), model, optimizer, extra={"step": 1})
    store.mark(f"{tag}/load_checkpoint")
    se.load_checkpoint(path, model, optimizer)
    store.mark(f"{tag}/stalled_step")
    if rank == 1:
        time.sleep(LATE_S)
    train_step(model, optimizer, rank)
    store.mark(f"{tag}/drop")
    del model, optimizer, net
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for trace_N<world>_rank<r>.json")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--hybrid", type=int, default=0, help="also shard_group_size=K at stage 3 (K divides N)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inner, _, _ = next(dist.rendezvous("env://"))  # the store init_process_group() would use
    store = RecordingStore(inner)
    store.mark("init_process_group")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    folder = os.path.join(args.out, f"checkpoints_N{world}")
    for stage in (int(s) for s in args.stages.split(",")):
        one_stage(store, stage, rank, folder, 0)
    if args.hybrid:
        one_stage(store, 3, rank, folder, args.hybrid)
    store.mark("destroy_process_group")
    dist.destroy_process_group()
    trace = {"world": world, "rank": rank, "torch": torch.__version__, "backend": "gloo",
             "requests": [[r.phase, r.op, r.key, r.nbytes, r.keys, round(r.seconds, 6)] for r in store.requests]}
    with open(os.path.join(args.out, f"trace_N{world}_rank{rank}.json"), "w") as f:
        json.dump(trace, f)


if __name__ == "__main__":
    main()
