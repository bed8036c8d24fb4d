"""The collectives the engine could issue, timed side by side at bucket and unit sizes.

    python benchmarks/bench_collectives.py                     # launches 2 CPU ranks itself
    python benchmarks/bench_collectives.py --sizes-mb 5,11,25,100 --rounds 30

shardengine's communicator picks one implementation per collective and backend
(with ``collectives="auto"`` on Gloo: reduce-scatter as an in-place all-reduce plus a
copy of the own chunk, all-gather as one in-place broadcast per rank; elsewhere the
single-tensor forms). This measures the candidates round-robin, so drift hits them
alike, and prints the median per size: the evidence behind that choice, rerunnable on
any machine. It calls torch.distributed directly on purpose: it measures the backend,
not the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from launch import relaunch, under_launcher  # benchmarks/launch.py


def candidates(full: torch.Tensor, shard: torch.Tensor, out: torch.Tensor, world: int) -> dict:
    # torch 2.13 renames the single-tensor forms; older releases only have the old names.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "all_gather (list)": lambda: dist.all_gather(list(full.chunk(world)), shard),
        "all_gather (single)": lambda: gather_single(full, shard),
        "reduce_scatter (list)": lambda: dist.reduce_scatter(out, list(full.chunk(world))),
        "reduce_scatter (single)": lambda: scatter_single(out, full),
        "all_reduce": lambda: dist.all_reduce(full),
        # In-place alternatives made of the two in-place Gloo primitives:
        "all_gather (broadcasts)": lambda: _broadcast_chunks(full, world),
        "reduce_scatter (all_reduce)": lambda: (dist.all_reduce(full),
                                                out.copy_(full.chunk(world)[dist.get_rank()])),
    }


def _broadcast_chunks(full: torch.Tensor, world: int) -> None:
    """An all-gather as one broadcast per rank, each of that rank's chunk, in place."""
    works = [dist.broadcast(chunk, src=rank, async_op=True) for rank, chunk in enumerate(full.chunk(world))]
    for work in works:
        work.wait()


def time_size(megabytes: float, rounds: int, warmup: int, device: torch.device) -> dict[str, float]:
    world = dist.get_world_size()
    numel = int(megabytes * 2**20 / 4) // world * world
    full = torch.randn(numel, device=device)
    shard, out = torch.randn(numel // world, device=device), torch.empty(numel // world, device=device)
    cases = candidates(full, shard, out, world)
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(warmup + rounds):
        for name, collective in cases.items():
            dist.barrier()
            started = time.perf_counter()
            collective()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(times[warmup:]) for name, times in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="5,11,25,100", help="full-buffer sizes in MiB (fp32)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, when this script launches torchrun itself")
    args = parser.parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # the old single-tensor names
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    sizes = [float(size) for size in args.sizes_mb.split(",")]
    rows = [(size, time_size(size, args.rounds, args.warmup, device)) for size in sizes]
    if dist.get_rank() == 0:
        names = list(rows[0][1])
        print(f"{dist.get_backend()}, N={dist.get_world_size()}, median ms of {args.rounds} rounds")
        for name in names:
            print(f"{name:>28} | " + " | ".join(f"{size:6.1f} MiB {medians[name] * 1e3:7.2f}" for size, medians in rows))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
