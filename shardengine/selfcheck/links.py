"""Collective bus bandwidth per size: all-gather, reduce-scatter, all-reduce, as the engine issues them.

Timed through the engine's ``Communicator`` (so on Gloo the all-gather is
broadcasts, as in training), each call between two barriers, every rank at
once, the slowest rank's median. Bus bandwidth is nccl-tests' figure: the bytes
the ring model says each rank sends, per second (all-reduce 2(N-1)/N·S,
all-gather and reduce-scatter (N-1)/N·S; ``Communicator.bytes_sent``).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import torch

from shardengine.distributed.communicator import Communicator

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclasses.dataclass(frozen=True)
class CollectiveTiming:
    kind: str
    full_bytes: int          # S: the whole buffer
    sent_bytes: int          # per rank, what the engine's collective sends for it
    seconds: float

    @property
    def bus_bandwidth(self) -> float:
        return self.sent_bytes / self.seconds


def synchronizer(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _issue(comm: Communicator, kind: str, full: torch.Tensor, shard: torch.Tensor) -> None:
    if kind == "all_reduce":
        comm.all_reduce(full)
    elif kind == "all_gather":
        comm.all_gather(full, shard)
    else:
        comm.reduce_scatter(shard, full)


def time_collectives(comm: Communicator, sizes: Sequence[int], rounds: int,
                     device: torch.device, dtype: torch.dtype = torch.float32) -> list[CollectiveTiming]:
    """Every kind at every size (bytes of the full buffer), rounds interleaved so drift hits all alike."""
    n = comm.world_size
    sync = synchronizer(device)
    barrier = lambda: comm.all_reduce(torch.zeros(1, device=device))  # noqa: E731
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffers = {size: torch.randn(max(n, size // itemsize // n * n), device=device).to(dtype) for size in sizes}
    shards = {size: torch.empty(buffers[size].numel() // n, device=device, dtype=dtype) for size in sizes}
    times: dict[tuple[str, int], list[float]] = {(k, s): [] for s in sizes for k in KINDS}
    for round_index in range(rounds + 1):   # the first round warms up
        for kind, size in times:
            barrier()
            sync()
            started = time.perf_counter()
            _issue(comm, kind, buffers[size], shards[size])
            sync()
            if round_index:
                times[(kind, size)].append(time.perf_counter() - started)
    # on the device: NCCL reduces only device tensors
    medians = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64, device=device)
    comm.all_reduce_max(medians)     # the slowest rank's median: what a step waits for
    return [CollectiveTiming(kind, buffers[size].numel() * itemsize,
                             comm.bytes_sent(kind, buffers[size].numel() * itemsize), seconds)
            for (kind, size), seconds in zip(times, medians.cpu().tolist())]


def overlap_fraction(comm: Communicator, device: torch.device) -> float:
    """Fraction of an all-reduce hidden when it runs while this rank computes (0 to 1)."""
    sync = synchronizer(device)
    a = torch.randn(256, 256, device=device)
    buffer = torch.randn(1 << 20, device=device)   # 4 MiB

    def timed(fn: Callable[[], None]) -> float:
        comm.all_reduce(torch.zeros(1, device=device))
        sync()
        started = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - started

    alone = timed(lambda: comm.all_reduce(buffer))
    repeats = max(1, int(alone / max(timed(lambda: a @ a), 1e-6)))
    compute = timed(lambda: [a @ a for _ in range(repeats)])

    def both() -> None:
        work = comm.all_reduce(buffer, async_op=True)
        for _ in range(repeats):
            a @ a
        work.wait()

    together = timed(both)
    hidden = torch.tensor([(alone + compute - together) / min(alone, compute)], dtype=torch.float64,
                          device=device)
    comm.all_reduce(hidden)
    return float(min(1.0, max(0.0, hidden.item() / comm.world_size)))
