"""Compressed collectives against the ones they would replace, on the real backend.

    python benchmarks/bench_compression.py                    # launches 2 CPU ranks itself
    python benchmarks/bench_compression.py --sizes-mb 5,25 --rounds 20 --powersgd-model 10m

Collective level only: each compressed candidate is the math of
``shardengine/distributed/compression/codecs.py`` and ``powersgd.py`` around one real
``torch.distributed`` call (an all-to-all, all-gather or all-reduce), timed
round-robin with the uncompressed collective it replaces, so machine drift hits
all alike. Per candidate: bytes one rank sends (the formula functions), median
ms, and the codec's own time (the same math without the communication). From
those, the break-even link bandwidth: with time = codec + bytes / bandwidth, a
compressed candidate wins on links slower than (bytes saved) / (codec time).
On loopback Gloo the "link" is memory, so the codec rarely pays here; the
break-even says where it would. The engine-level table (step time and
validation loss of the example GPT per ``compression=`` option of ``shard()``)
is ``benchmarks/bench_compression_training.py``.

It calls torch.distributed directly on purpose: it measures candidates, not the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardengine.distributed.compression import codecs as cmp  # noqa: E402
from shardengine.distributed.traffic import ring_bytes  # noqa: E402
from shardengine.testing.models import build_gpt  # noqa: E402
from shardengine.distributed.compression.powersgd import PowerSGDState, plan_powersgd  # noqa: E402
from launch import relaunch, under_launcher  # benchmarks/launch.py


class Candidate:
    """One way to do a collective: ``run()`` does it all, ``codec()`` the math alone."""

    def __init__(self, name: str, nbytes: int, run: Callable[[], object], codec: Callable[[], object] | None = None):
        self.name, self.nbytes, self.run, self.codec = name, nbytes, run, codec


# --------------------------------------------------------------------------- reduce-scatter


def _exchange(messages: list, rank: int, world: int, message_numel: int, dtype: torch.dtype) -> list:
    """One all-to-all of equal messages (the own slot empty); received[src], None at ``rank``."""
    splits = [0 if peer == rank else message_numel for peer in range(world)]
    send = torch.cat([m for m in messages if m is not None]) if world > 1 else torch.empty(0, dtype=dtype)
    received = torch.empty((world - 1) * message_numel, dtype=dtype)
    dist.all_to_all_single(received, send, output_split_sizes=splits, input_split_sizes=splits)
    pieces = iter(received.split(message_numel))
    return [None if src == rank else next(pieces) for src in range(world)]


def int8_reduce_scatter(flat, rank, world, block, feedback, communicate=True) -> torch.Tensor:
    chunk = flat.numel() // world
    messages = [None if m is None else cmp.pack(m) for m in
                cmp.encode_reduce_scatter(flat, rank, world, block, feedback)]
    if communicate:
        received = _exchange(messages, rank, world, cmp.payload_bytes(chunk, block), torch.uint8)
    else:
        received = messages  # the codec alone: decode what we would have sent
    decoded = [None if m is None else cmp.unpack(m, chunk, block) for m in received]
    return cmp.decode_reduce_scatter(cmp.split_chunks(flat, world)[rank], decoded)


def low_precision_reduce_scatter(flat, rank, world, policy, communicate=True) -> torch.Tensor:
    messages = cmp.encode_low_precision(flat, rank, world, policy)
    if communicate:
        messages = _exchange(messages, rank, world, flat.numel() // world, policy.wire)
    return cmp.decode_low_precision(cmp.split_chunks(flat, world)[rank], messages, policy)


def reduce_scatter_candidates(numel: int, block: int) -> list[Candidate]:
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = torch.randn(numel)
    summed, out = grads.clone(), torch.empty(numel // world)
    feedback = cmp.ErrorFeedback(numel)
    bf16 = cmp.cast_policy("bf16")

    def fp32_all_reduce():  # the engine's reduce-scatter on Gloo: in-place all-reduce, keep own chunk
        summed.copy_(grads)
        dist.all_reduce(summed)
        out.copy_(summed.chunk(world)[rank])

    return [
        Candidate("RS fp32 (native)", ring_bytes("reduce_scatter", 4 * numel, world),
                  lambda: dist.reduce_scatter_tensor(out, grads)),
        Candidate("RS fp32 (all_reduce)", ring_bytes("all_reduce", 4 * numel, world), fp32_all_reduce),
        Candidate("RS bf16 all-to-all", cmp.low_precision_reduce_scatter_bytes(numel, world, "bf16"),
                  lambda: low_precision_reduce_scatter(grads, rank, world, bf16),
                  lambda: low_precision_reduce_scatter(grads, rank, world, bf16, communicate=False)),
        Candidate("RS int8+EF all-to-all", cmp.quantized_reduce_scatter_bytes(numel, world, block),
                  lambda: int8_reduce_scatter(grads, rank, world, block, feedback),
                  lambda: int8_reduce_scatter(grads, rank, world, block, feedback, communicate=False)),
    ]


# --------------------------------------------------------------------------- all-gather


def int8_all_gather(shard, world, block, communicate=True) -> torch.Tensor:
    message = cmp.pack(cmp.encode_all_gather(shard, block))
    gathered = torch.empty(world * message.numel(), dtype=torch.uint8)
    if communicate:
        dist.all_gather_into_tensor(gathered, message)
    else:
        gathered = message.repeat(world)
    received = [cmp.unpack(m, shard.numel(), block) for m in gathered.chunk(world)]
    return cmp.decode_all_gather(received)


def all_gather_candidates(numel: int, block: int) -> list[Candidate]:
    world = dist.get_world_size()
    full = torch.randn(numel)
    shard = full.chunk(world)[dist.get_rank()].clone()

    def fp32_broadcasts():  # the engine's all-gather on Gloo: one in-place broadcast per rank
        works = [dist.broadcast(c, src=r, async_op=True) for r, c in enumerate(full.chunk(world))]
        for work in works:
            work.wait()

    return [
        Candidate("AG fp32 (broadcasts)", ring_bytes("all_gather", 4 * numel, world), fp32_broadcasts),
        Candidate("AG fp32 (native)", ring_bytes("all_gather", 4 * numel, world),
                  lambda: dist.all_gather_into_tensor(full, shard)),
        Candidate("AG int8", cmp.quantized_all_gather_bytes(numel, world, block),
                  lambda: int8_all_gather(shard, world, block),
                  lambda: int8_all_gather(shard, world, block, communicate=False)),
    ]


# --------------------------------------------------------------------------- PowerSGD (stage 0)


def powersgd_all_reduce(state: PowerSGDState, grads: list[torch.Tensor], communicate=True) -> list[torch.Tensor]:
    def all_reduce(tensors):
        if tensors and communicate:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat)
            return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
        return tensors

    dense = all_reduce([grads[i] for i in state.plan.dense])
    q_sums = all_reduce(state.compute_q(all_reduce(state.compute_p(grads))))
    return state.decompress(q_sums) + dense


def powersgd_candidates(model_name: str, rank_r: int) -> tuple[int, list[Candidate]]:
    world = dist.get_world_size()
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in build_gpt(model_name).parameters()]
    grads = [torch.randn(shape) for shape in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    plan = plan_powersgd(shapes, rank_r)
    state, codec_state = PowerSGDState(plan, seed=0), PowerSGDState(plan, seed=0)
    return flat.numel(), [
        Candidate("AR fp32", ring_bytes("all_reduce", 4 * flat.numel(), world), lambda: dist.all_reduce(flat)),
        Candidate(f"AR PowerSGD r={rank_r}", plan.wire_bytes(world), lambda: powersgd_all_reduce(state, grads),
                  lambda: powersgd_all_reduce(codec_state, grads, communicate=False)),
    ]


# --------------------------------------------------------------------------- timing and report


def time_candidates(candidates: list[Candidate], rounds: int, warmup: int) -> dict[str, tuple[float, float]]:
    """Median seconds per candidate: (whole collective, codec alone or 0)."""
    runs = {c.name: [] for c in candidates}
    codecs = {c.name: [] for c in candidates}
    for _ in range(warmup + rounds):
        for candidate in candidates:
            dist.barrier()
            started = time.perf_counter()
            candidate.run()
            runs[candidate.name].append(time.perf_counter() - started)
            if candidate.codec:
                started = time.perf_counter()
                candidate.codec()
                codecs[candidate.name].append(time.perf_counter() - started)
    return {name: (statistics.median(runs[name][warmup:]),
                   statistics.median(codecs[name][warmup:]) if codecs[name] else 0.0) for name in runs}


def report(title: str, candidates: list[Candidate], medians: dict[str, tuple[float, float]]) -> None:
    baseline = candidates[0]
    print(f"\n{title}")
    print(f"{'candidate':>24} | {'MiB/rank':>8} | {'bytes':>6} | {'ms':>8} | {'time':>6} | {'codec ms':>8} | break-even")
    for c in candidates:
        seconds, codec = medians[c.name]
        saved = baseline.nbytes - c.nbytes
        even = f"{saved / codec / 1e9:6.2f} GB/s" if codec and saved > 0 else "-"
        print(f"{c.name:>24} | {c.nbytes / 2**20:8.2f} | {c.nbytes / baseline.nbytes:6.3f} | {seconds * 1e3:8.2f} | "
              f"{seconds / medians[baseline.name][0]:6.2f} | {codec * 1e3:8.2f} | {even}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="5,25", help="fp32 gradient bucket sizes in MiB")
    parser.add_argument("--block-size", type=int, default=cmp.DEFAULT_BLOCK_SIZE)
    parser.add_argument("--powersgd-model", default="10m", help="GPT preset whose gradients PowerSGD compresses")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, when this script launches torchrun itself")
    args = parser.parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    torch.manual_seed(int(os.environ["RANK"]))
    dist.init_process_group("gloo")
    world, main_rank = dist.get_world_size(), dist.get_rank() == 0
    if main_rank:
        print(f"gloo, N={world}, block {args.block_size}, median of {args.rounds} rounds; 'bytes' and 'time' "
              "are ratios to the first row; break-even: links slower than this favour the candidate")
    for megabytes in (float(size) for size in args.sizes_mb.split(",")):
        numel = int(megabytes * 2**20 / 4) // world * world
        for kind, build in (("reduce-scatter", reduce_scatter_candidates), ("all-gather", all_gather_candidates)):
            candidates = build(numel, args.block_size)
            medians = time_candidates(candidates, args.rounds, args.warmup)
            if main_rank:
                report(f"{kind} of {megabytes:g} MiB fp32", candidates, medians)
    numel, candidates = powersgd_candidates(args.powersgd_model, args.powersgd_rank)
    medians = time_candidates(candidates, args.rounds, args.warmup)
    if main_rank:
        report(f"all-reduce of GPT {args.powersgd_model} gradients ({numel * 4 / 2**20:.1f} MiB fp32)",
               candidates, medians)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
