"""Training script every rank of the two-agent ("two nodes") test runs under torchrun.

    torchrun --nnodes 2 --node-rank R --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID tests/multinode_train.py --out final.pt ...

Trains ``engine_cases``'s tiny model at ``--stage`` on each rank's slice of the global
batches (``engine_cases.batch``, the same ones a single-process reference uses), with
accumulation and clipping; saves the full parameters (rank 0) and writes ``--marker``.
With ``--keep-training`` it then trains on until a collective fails, and prints one
line ``COLLECTIVE_ERROR <unix time> <type>: <message>`` (exit 3), so a test that kills
the other node can check the error and when it came.

``shard_options`` turns the arguments into ``se.shard`` options: the place to add
another sharding argument (e.g. ``--shard-group-size``) for a variant of the test.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import batch, build_model, make_optimizer

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
    return parser.parse_args(argv)


def shard_options(args: argparse.Namespace) -> dict:
    """``se.shard`` options from the arguments."""
    return {"stage": args.stage, "timeout_s": args.timeout_s}


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
    optimizer = make_optimizer(net, SPEC["optimizer"])
    for step in range(steps):
        for micro in range(SPEC["micro_steps"]):
            ids, targets = batch(SPEC, step, micro, world)
            (F.cross_entropy(net(ids), targets) / SPEC["micro_steps"]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), SPEC["max_norm"])
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().clone() for key, value in net.state_dict().items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    info = se.init_distributed(timeout_s=args.timeout_s)
    torch.manual_seed(SPEC["seed"])
    net = build_model(SPEC)
    model, optimizer = se.shard(net, make_optimizer(net, SPEC["optimizer"]), **shard_options(args))
    for step in range(args.steps):
        train_step(model, optimizer, step, info.rank, info.world_size)
    state = model.full_state_dict(rank0_only=True)
    if info.rank == 0:
        torch.save(state, args.out)
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
        print(f"COLLECTIVE_ERROR {time.time():.3f} {type(error).__name__}: {error}", flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
