#!/usr/bin/env python3
"""The disk tier against the optimizer in memory: resident memory, step time, same weights (docs/offload.md).

    python benchmarks/bench_disk_offload.py --path /var/tmp    # torchrun per stage and tier (N=2)
    python benchmarks/bench_disk_offload.py --layers 4 --width 1024 --steps 2   # a quick look
    python benchmarks/bench_disk_offload.py --path /var/tmp --stages 3   # stage 3's three tiers only

A stack of ``--layers`` square linear layers (Adam, bf16 parameters over fp32
masters, micro-batch of ``--tokens`` rows, so the optimizer's bytes dominate and
the compute is small) trains ``--steps`` steps at each stage, once with the
optimizer state in memory (``offload_optimizer=True``: host memory, the same CPU
step) and once on the disk tier (``offload_optimizer="disk"``) with its files
under ``--path``; at stage 3 a third time with the parameter shards on disk too
(``offload_params="disk"``: only the units being gathered and the buckets being
stepped are read in). Per stage and rank it reports the median step time after a
warm-up step, the resident set before the steps and its high-water mark during
them (Linux ``VmHWM``, reset after ``shard()``; each run is a fresh torchrun),
the optimizer state's bytes (Adam's two moments, and the fp32 master) on this
rank, and whether both runs end with bit-identical weights (a digest of every
bucket's parameters and master on every rank).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardengine as se
from launch import torchrun  # benchmarks/launch.py


class Stack(nn.Module):
    """Square linear layers, each a stage-3 unit (an element of a block list) and its own bucket."""

    def __init__(self, layers: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return Stack(layers, width)


def resident_high_water() -> int:
    """This process's peak resident set since the last reset, in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: the resident high-water mark needs Linux")


def reset_high_water() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak resident set to the current


def digest(model) -> str:
    """Every bucket's compute parameters and fp32 master on this rank, as one hash."""
    sha = hashlib.sha256()
    for bucket in model.engine.buckets:
        for tensor in (bucket.kept_shard, bucket.master):
            if tensor is not None and tensor.numel():
                sha.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def tier_options(tier: str, path: str) -> dict:
    """``shard()``'s offload keywords for a tier of the table."""
    return {"memory": {"offload_optimizer": True},
            "disk": {"offload_optimizer": "disk", "offload_path": path},
            "params-disk": {"offload_params": "disk", "offload_path": path}}[tier]


def run(stage: int, tier: str, args) -> dict:
    options = tier_options(tier, args.path)
    net = build(args.layers, args.width)
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=1e-4), stage=stage,
                                param_dtype="bf16", bucket_mb=args.bucket_mb, **options)
    del net
    generator = torch.Generator().manual_seed(dist.get_rank())
    reset_high_water()
    at_start = resident_high_water()  # what the process held before the steps (torch, the data, the model)
    times = []
    for _ in range(args.steps):
        batch = torch.randn(args.tokens, args.width, generator=generator).bfloat16()
        dist.barrier()
        start = time.perf_counter()
        model(batch).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    high_water = resident_high_water()
    report = model.memory_report()
    moments = report.optimizer_states + report.host_optimizer_states + report.disk_optimizer_states
    masters = sum(b.master.numel() * 4 for b in model.engine.stepped_buckets())
    # with the parameters on disk a master is the parameter shard: memory_report() counts it in
    # disk_params, not with the optimizer (stages/reports.py, [Note: an offloaded master is a parameter])
    moments -= 0 if tier == "params-disk" else masters
    row = {"stage": stage, "tier": tier,
           "step_s": statistics.median(times[1:] or times), "hwm": high_water, "start": at_start,
           "adam_moments": moments, "masters": masters, "disk": report.disk_optimizer_states + report.disk_params,
           "digest": digest(model)}
    return row


def launch_runs(args) -> int:
    """One torchrun per (stage, tier), so each resident-set figure is of a fresh process."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for stage in (int(s) for s in args.stages.split(",")):
            for tier in ("memory", "disk") + (("params-disk",) if stage == 3 else ()):
                out = os.path.join(scratch, f"{stage}-{tier}.json")
                code = torchrun(str(Path(__file__).resolve()), args.nproc,
                                [*sys.argv[1:], "--run", f"{stage},{tier}", "--out", out], echo=True)
                if code:
                    return code
                rows.append(json.loads(Path(out).read_text()))
    print_table(rows, args)
    return 0


def print_table(rows: list[list[dict]], args) -> None:
    """``rows``: per run, every rank's row; each stage's runs in a row, its memory run first."""
    params = args.layers * (args.width + 1) * args.width
    print(f"{args.layers} x Linear({args.width}, {args.width}) (~{params / 1e6:.0f}M parameters), Adam, bf16 "
          f"over fp32 masters, N={args.nproc}, {args.steps} steps, files under {args.path}")
    print("stage | tier | step s (median) | ratio | per rank: resident before the steps -> high-water "
          "during them, MiB (growth) | Adam moments + fp32 master per rank, MiB | same weights")
    for stage in dict.fromkeys(run[0]["stage"] for run in rows):
        memory, *others = [run for run in rows if run[0]["stage"] == stage]
        for run in (memory, *others):
            same = all(m["digest"] == r["digest"] for m, r in zip(memory, run)) if run is not memory else ""
            first = run[0]
            resident = ", ".join(f"{r['start'] / 2**20:.0f} -> {r['hwm'] / 2**20:.0f} "
                                 f"(+{(r['hwm'] - r['start']) / 2**20:.0f})" for r in run)
            print(f"{first['stage']} | {first['tier']} | {first['step_s']:.3f} | "
                  f"{first['step_s'] / memory[0]['step_s']:.2f} | {resident} | "
                  f"{first['adam_moments'] / 2**20:.0f} + {first['masters'] / 2**20:.0f} | {same}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=8.0, help="bucket size at stages 1-2 (a layer at stage 3)")
    p.add_argument("--path", default=".", help="directory for the disk tier's files (not a tmpfs)")
    p.add_argument("--run", help=argparse.SUPPRESS)  # "stage,tier": one run, under torchrun
    p.add_argument("--out", help=argparse.SUPPRESS)  # where rank 0 writes that run's rows
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        return launch_runs(args)
    se.init_distributed()
    torch.set_num_threads(1)
    stage, tier = args.run.split(",")
    row = run(int(stage), tier, args)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, row)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
