"""Weight sync to a colocated rollout model: time against bytes and the ring bound, peak against cap.

    python benchmarks/bench_weight_sync.py                    # launches 2 CPU ranks itself
    python benchmarks/bench_weight_sync.py --size 50m --caps-mb 8,32 --rounds 5

A GPT of ``--size`` (the tests' model; 100m: 99M parameters, 397 MB in fp32) is sharded at stage 3
(fp32 masters) and at stage 0, and streamed with ``model.stream_weights(dtype="bf16",
bucket_bytes=cap)`` into a bf16 copy of itself on every rank, loaded in place (``ModuleReceiver``):
a colocated rollout. For each configuration, round-robin, median of ``--rounds``:

* ``sync s``: the whole sync (gathers, casts, loads);
* ``ring bound s``: the bytes each rank must receive, (N-1)/N of the model in bf16, at the link's
  bandwidth (16 MiB broadcasts, measured in the same run); the header also gives one all-gather
  of the whole bf16 model into one buffer (the uncapped export: S bytes held at once);
* ``peak MiB``: every block the allocator handed out during one more sync, under the
  allocator tracker (a separate pass: the profiler slows it), against the cap and against the
  stream's promised bound (the cap, or one tensor above it).

Rank 0 prints a markdown table (docs/rl.md quotes it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import shardengine as se
from shardengine.distributed.communicator import Communicator
from launch import relaunch, under_launcher  # benchmarks/launch.py
from shardengine.rl import ModuleReceiver, WeightSync
from shardengine.testing.allocator_tracker import AllocatorTracker
from shardengine.testing.models import build_gpt

MiB = 2**20


def configurations(caps_mb: list[float]) -> list[dict]:
    rows = [dict(stage=3, cap=cap, overlap=True, receivers="all") for cap in caps_mb]
    rows.append(dict(stage=3, cap=caps_mb[len(caps_mb) // 2], overlap=False, receivers="all"))
    rows.append(dict(stage=3, cap=caps_mb[len(caps_mb) // 2], overlap=True, receivers=[0]))
    rows.append(dict(stage=0, cap=caps_mb[len(caps_mb) // 2], overlap=True, receivers="all"))
    return rows


def one_sync(model, rollout: torch.nn.Module, row: dict) -> float:
    receiver = ModuleReceiver(rollout)
    receiver.receivers = row["receivers"]
    sync = WeightSync(model, receiver, dtype="bf16", bucket_bytes=int(row["cap"] * MiB), overlap=row["overlap"])
    dist.barrier()
    started = time.perf_counter()
    sync.sync()
    dist.barrier()
    return time.perf_counter() - started


def tracked_peak(model, rollout: torch.nn.Module, row: dict) -> tuple[int, int]:
    stream = model.stream_weights(dtype="bf16", bucket_bytes=int(row["cap"] * MiB), overlap=row["overlap"],
                                  receivers=row["receivers"])
    receiver = ModuleReceiver(rollout, strict=False)
    with AllocatorTracker() as tracker:
        with tracker.phase("sync"):
            for bucket in stream:
                receiver.load(bucket)
    return tracker.peak_in("sync", since="sync"), stream.bound_bytes


def whole_gather_seconds(model_bytes: int) -> float:
    """One all-gather of the whole bf16 model into one buffer (the uncapped export: S bytes held)."""
    world = dist.get_world_size()
    numel = model_bytes // 2 // world * world
    full = torch.empty(numel, dtype=torch.bfloat16)
    comm = Communicator.create()
    shard = full.chunk(world)[dist.get_rank()]
    dist.barrier()
    started = time.perf_counter()
    comm.all_gather(full, shard)
    return time.perf_counter() - started


def link_bandwidth(megabytes: float = 16, repeats: int = 5) -> float:
    """Bytes per second one rank receives: the median of broadcasts of ``megabytes``, each rank the source in turn."""
    tensor = torch.empty(int(megabytes * MiB) // 2, dtype=torch.bfloat16)
    times = []
    for repeat in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(tensor, src=repeat % dist.get_world_size())
        times.append(time.perf_counter() - started)
    return tensor.numel() * 2 / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100m", help="GPT preset (shardengine.testing.models)")
    parser.add_argument("--caps-mb", default="16,64,256", help="bucket_bytes caps to compare, MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    se.init_distributed()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = configurations([float(c) for c in args.caps_mb.split(",")])
    models = {}
    for stage in sorted({row["stage"] for row in rows}):
        net = build_gpt(args.size)
        models[stage], _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage)
    rollout = build_gpt(args.size).to(torch.bfloat16)
    model_bytes = sum(t.numel() * 2 for t in rollout.state_dict().values())
    seconds: dict[int, list[float]] = {i: [] for i in range(len(rows))}
    gathers, bandwidths = [], []
    for _ in range(args.rounds):
        gathers.append(whole_gather_seconds(model_bytes))
        bandwidths.append(link_bandwidth())
        for index, row in enumerate(rows):
            seconds[index].append(one_sync(models[row["stage"]], rollout, row))
    bandwidth = statistics.median(bandwidths)
    ring_bound = (world - 1) / world * model_bytes / bandwidth  # what each rank must receive, at link speed
    peaks = [tracked_peak(models[row["stage"]], rollout, row) for row in rows]
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, peaks)
    peaks = [(max(p[i][0] for p in every_rank), peaks[i][1]) for i in range(len(rows))]
    if rank == 0:
        print(f"\n{args.size} GPT, {model_bytes / MiB:.0f} MiB in bf16, N = {world} (Gloo, CPU), median of "
              f"{args.rounds}; link {bandwidth / 1e9:.2f} GB/s (16 MiB broadcasts); one all-gather of the whole "
              f"bf16 model into one buffer: {statistics.median(gathers):.3f} s\n")
        print("| stage | cap MiB | overlap | receivers | sync s | ring bound s | sync / bound | peak MiB (max over ranks) "
              "| bound MiB |")
        print("|---:|---:|---|---|---:|---:|---:|---:|---:|")
        for index, row in enumerate(rows):
            sync_s = statistics.median(seconds[index])
            bound = ring_bound if row["stage"] == 3 else 0.0
            ratio = f"{sync_s / bound:.2f}" if bound else "no gather"
            peak, promised = peaks[index]
            print(f"| {row['stage']} | {row['cap']:.0f} | {'on' if row['overlap'] else 'off'} | {row['receivers']} | "
                  f"{sync_s:.3f} | {bound:.3f} | {ratio} | {peak / MiB:.1f} | {promised / MiB:.1f} |")
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
