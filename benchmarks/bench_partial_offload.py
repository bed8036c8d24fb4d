#!/usr/bin/env python3
"""Fractional parameter offload: each tier's bytes and the step time per fraction (docs/offload.md).

    python benchmarks/bench_partial_offload.py                     # 8 x Linear(1024), 4 steps
    python benchmarks/bench_partial_offload.py --layers 4 --width 256 --steps 2   # a quick look

A stack of ``--layers`` square linear layers (each a stage-3 unit; Adam, bf16 parameters
over fp32 masters) trains ``--steps`` steps in one process at stage 3 with no offload,
``offload_params`` = 0.25, 0.5, 0.75 and True. Per run: the units moved to the host,
``memory_report()``'s model states on the device and on the host, the median step time
after a warm-up step, and whether the weights equal the resident run's bit for bit.
Without a GPU the host is the device, so the time shows the cost of the real copies and of
the CPU step's bookkeeping, not of a PCIe link.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import shardengine as se

SETTINGS = [("resident", {}), ("0.25", {"offload_params": 0.25}), ("0.5", {"offload_params": 0.5}),
            ("0.75", {"offload_params": 0.75}), ("all", {"offload_params": True})]


def run(layers: int, width: int, steps: int, options: dict) -> tuple:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=1e-4), stage=3, param_dtype="bf16",
                                wrap_min_params=width * width, **options)
    batch = torch.randn(64, width, generator=torch.Generator().manual_seed(1)).bfloat16()
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        model(batch).float().square().mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    report = model.memory_report()  # gradients held until the next zero_grad
    moved = sum(any(b.param_home is not None for b in u.buckets) for u in model.engine.layout.units)
    weights = {k: v.clone() for k, v in model.full_state_dict().items()}
    return moved, report, statistics.median(times[1:]), weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.layers} x Linear({args.width}), Adam, bf16 over fp32 masters, stage 3, one process, "
          f"median of {args.steps} steps")
    print("| offload_params | units on host | device model states MiB | host model states MiB | step s | same weights |")
    print("|---|---|---|---|---|---|")
    reference = None
    for name, options in SETTINGS:
        moved, report, seconds, weights = run(args.layers, args.width, args.steps, options)
        reference = reference or weights
        same = all(torch.equal(reference[k], weights[k]) for k in reference)
        print(f"| {name} | {moved} | {report.model_states / 2**20:.1f} | {report.host_model_states / 2**20:.1f} "
              f"| {seconds:.3f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
