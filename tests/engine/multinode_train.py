"""Training script every rank of the two-agent ("two nodes") test runs under torchrun.

    torchrun --nnodes 2 --node-rank R --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID tests/engine/multinode_train.py --out final.pt ...

Trains ``engine_cases``'s tiny model at ``--stage`` on each rank's slice of the global
batches (``engine_cases.batch``, the same ones a single-process reference uses), with
accumulation and clipping; saves the full parameters (rank 0) and writes ``--marker``.
With ``--keep-training`` it then trains on until a collective fails, and prints one
line ``COLLECTIVE_ERROR <unix time> <type>: <message>`` (exit 3), so a test that kills
the other node can check the error and when it came.

``shard_options`` turns the arguments into ``se.shard`` options. ``--shard-group-size``
(hybrid sharding; ``node``: one shard group per node; ``all``: plain sharding) may be
given several times: each value trains a fresh model in the same launch, saved to
``output_path(out, value)``, with what rank 0 sent per group in the last step in
``<that path>.bytes.json``; ``--keep-training`` goes on with the last one.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import batch
from toy_models import build_model, make_optimizer

SPEC = {"seed": 3, "vocab": 13, "dim": 6, "hidden": [7, 5], "tied": True, "per_rank_batch": 3,
        "micro_steps": 2, "optimizer": "adamw", "max_norm": 0.5}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="the engine's collective timeout")
    parser.add_argument("--out", required=True, help="rank 0 saves the final full parameters here")
    parser.add_argument("--marker", default=None, help="written (rank 0) once the parameters are saved")
    parser.add_argument("--keep-training", action="store_true", help="then train until a collective fails")
    parser.add_argument("--shard-group-size", action="append", default=None,
                        help="hybrid sharding: ranks per shard group, 'node' or 'all' (the default); "
                             "repeat to train one model per value")
    return parser.parse_args(argv)


def shard_options(args: argparse.Namespace, group_size: str = "all") -> dict:
    """``se.shard`` options from the arguments (``group_size``: one ``--shard-group-size`` value)."""
    size = None if group_size == "all" else int(group_size) if group_size.isdigit() else group_size
    return {"stage": args.stage, "timeout_s": args.timeout_s, "shard_group_size": size}


def output_path(out: str, group_size: str = "all") -> str:
    """Where the model trained with ``--shard-group-size group_size`` is saved."""
    return out if group_size == "all" else f"{out}.group-{group_size}"


def train_step(model, optimizer, step: int, rank: int, world: int) -> None:
    micro_steps, b = SPEC["micro_steps"], SPEC["per_rank_batch"]
    mine = slice(rank * b, (rank + 1) * b)
    for micro in range(micro_steps):
        ids, targets = batch(SPEC, step, micro, world)
        with contextlib.nullcontext() if micro == micro_steps - 1 else model.no_sync():
            (F.cross_entropy(model(ids[mine]), targets[mine]) / micro_steps).backward()
    model.clip_grad_norm_(SPEC["max_norm"])
    optimizer.step()
    optimizer.zero_grad()


def reference_state(steps: int, world: int) -> dict[str, torch.Tensor]:
    """The same training in one process on the global batches: what every layout must match."""
    torch.manual_seed(SPEC["seed"])
    net = build_model(SPEC)
    optimizer = make_optimizer(net, SPEC["optimizer"], groups="blocks")
    for step in range(steps):
        for micro in range(SPEC["micro_steps"]):
            ids, targets = batch(SPEC, step, micro, world)
            (F.cross_entropy(net(ids), targets) / SPEC["micro_steps"]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), SPEC["max_norm"])
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().clone() for key, value in net.state_dict().items()}


def train_and_save(args: argparse.Namespace, info, group_size: str):
    """A fresh model trained ``--steps`` steps; rank 0 saves it (and the last step's bytes)."""
    torch.manual_seed(SPEC["seed"])
    net = build_model(SPEC)
    model, optimizer = se.shard(net, make_optimizer(net, SPEC["optimizer"], groups="blocks"), **shard_options(args, group_size))
    for step in range(args.steps):
        model.step_stats()  # restart the per-step counters: the last step's traffic is reported
        train_step(model, optimizer, step, info.rank, info.world_size)
    last_step = model.step_stats()
    state = model.full_state_dict(rank0_only=True)
    if info.rank == 0:
        out = output_path(args.out, group_size)
        with open(out + ".bytes.json", "w") as report:
            json.dump({"shard_group_size": model.shard_group_size, "by_group": last_step.bytes_by_group,
                       "ring_model_by_group": model.ring_model_bytes_by_group(SPEC["micro_steps"])}, report)
        torch.save(state, out)
    return model, optimizer


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    info = se.init_distributed(timeout_s=args.timeout_s)
    for group_size in args.shard_group_size or ["all"]:
        model, optimizer = train_and_save(args, info, group_size)
    if info.rank == 0:
        if args.marker:
            with open(args.marker, "w") as marker:
                marker.write(f"trained {args.steps} steps on {info.world_size} ranks\n")
    print(f"rank {info.rank}/{info.world_size}: trained {args.steps} steps", flush=True)
    if not args.keep_training:
        return 0
    step = args.steps
    try:
        while True:
            train_step(model, optimizer, step, info.rank, info.world_size)
            step += 1
            time.sleep(0.05)
    except se.CollectiveError as error:
        # One write with a newline on both sides: two ranks share node 0's log, and separate
        # writes for the text and its newline can interleave into one line.
        line = f"\nCOLLECTIVE_ERROR {time.time():.3f} {type(error).__name__}: {error}\n"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())
        return 3


if __name__ == "__main__":
    sys.exit(main())
