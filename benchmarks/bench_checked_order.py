#!/usr/bin/env python3
"""What stage 3's checked collective order costs: the same model with and without its rounds.

    python benchmarks/bench_checked_order.py                 # 2 CPU ranks, 10m GPT, ~1 minute
    python benchmarks/bench_checked_order.py --nproc 3 --steps 20

Before each stage-3 collective the ranks exchange 24 bytes on a Gloo side group
([Note: checked collective order], shardengine/distributed/sequence.py). Two stage-3
models are built in the same processes from the same init; the second has its rounds
switched off (which only a model whose ranks run the same modules survives), and the
timed steps alternate between them, each between two barriers. Rank 0 prints the median
step of each, their ratio and the rounds held per step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import relaunch, under_launcher  # noqa: E402
from timed import timed_step  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--size", default="10m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardengine as se
    from shardengine.testing.models import build_gpt, example_inputs, lm_loss

    se.init_distributed()
    torch.set_num_threads(1)
    ids, targets = example_inputs(2, args.seq_len, vocab_size=256, seed=dist.get_rank())
    models, times = {}, {}
    for name in ("checked", "unchecked"):
        net = build_gpt(args.size, vocab_size=256, seq_len=args.seq_len, seed=0)
        model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=3)
        if name == "unchecked":  # a benchmark's switch, not an option: see the module docstring
            model.engine.layout.order.sequence.enabled = False
        models[name], times[name] = (model, optimizer), []
    for _ in range(args.steps):
        for name, (model, optimizer) in models.items():
            times[name].append(timed_step(model, optimizer, ids, targets, lm_loss))
    rounds = models["checked"][0].engine.layout.order.sequence.rounds / args.steps
    if dist.get_rank() == 0:
        medians = {name: statistics.median(values[2:]) for name, values in times.items()}
        for name, median in medians.items():
            print(f"{name:10s} median step {median * 1e3:8.1f} ms")
        print(f"checked / unchecked: {medians['checked'] / medians['unchecked']:.3f}x, "
              f"{rounds:.1f} rounds per step, N={dist.get_world_size()}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
