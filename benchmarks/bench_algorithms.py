#!/usr/bin/env python3
"""Why all-reduce: four ways to sum a buffer over N ranks, built from sends and receives.

    python benchmarks/bench_algorithms.py                        # N = 2, 3, 4; ~2 minutes here
    python benchmarks/bench_algorithms.py --ranks 2,4 --sizes-kib 64,4096 --rounds 5

With point-to-point ``send``/``recv`` over torch.distributed (Gloo on 127.0.0.1 on
CPU), it implements

* **parameter server**: every worker sends its buffer to rank 0, which sums and sends
  the result back to each: rank 0 moves 2(N-1)·S bytes, O(N);
* **reduce-then-broadcast**: a binomial-tree reduce to rank 0, then a binomial-tree
  broadcast of whole buffers: 2·ceil(log2 N)·S on the busiest rank;
* **ring**: reduce-scatter then all-gather around a ring of N chunks: 2(N-1)/N·S per rank;
* **halving-doubling** (Rabenseifner): recursive halving reduce-scatter then doubling
  all-gather, log2 N steps each (non-powers of two fold the extra ranks in first);

checks each against the exact sum, and times them round-robin with the backend's own
``all_reduce`` at each size (between barriers, median of ``--rounds``, the slowest
rank). Beside each measurement it prints the alpha-beta prediction
(``memory_estimator.timing.collectives``), with alpha and beta fitted to a ping-pong
between ranks 0 and 1 of the same run, and the bytes rank 0 sent and received, in
units of S. One torchrun launch per N. It writes ``benchmarks/results/bench_algorithms.json``
and ``.png`` (matplotlib: ``pip install -e '.[bench]'``). A benchmark, not the engine:
it calls torch.distributed directly on purpose.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_estimator.hardware.calibration import fit_alpha_beta  # noqa: E402
from memory_estimator.timing.collectives import (halving_doubling_all_reduce, parameter_server_all_reduce,  # noqa: E402
                                              reduce_broadcast_all_reduce, ring_all_reduce)
from launch import torchrun  # noqa: E402  (benchmarks/launch.py)

RESULTS = ROOT / "benchmarks" / "results"
ALGORITHMS = ("parameter_server", "reduce_broadcast", "ring", "halving_doubling", "backend")
PREDICTORS = {"parameter_server": parameter_server_all_reduce, "reduce_broadcast": reduce_broadcast_all_reduce,
              "ring": ring_all_reduce, "halving_doubling": halving_doubling_all_reduce,
              "backend": ring_all_reduce}  # Gloo's CPU all-reduce is a ring


# --------------------------------------------------------------------------- point to point, counted


class P2P:
    """Sends and receives of this rank, with the bytes each way counted."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()
        self.sent = self.received = 0

    def send(self, tensor, peer: int) -> None:
        self.sent += tensor.numel() * tensor.element_size()
        self.dist.send(tensor, peer)

    def recv(self, tensor, peer: int) -> None:
        self.received += tensor.numel() * tensor.element_size()
        self.dist.recv(tensor, peer)

    def exchange(self, send_tensor, send_to: int, recv_tensor, recv_from: int) -> None:
        """Send and receive at once (both directions of a link busy), then wait for both."""
        self.sent += send_tensor.numel() * send_tensor.element_size()
        self.received += recv_tensor.numel() * recv_tensor.element_size()
        works = [self.dist.isend(send_tensor, send_to), self.dist.irecv(recv_tensor, recv_from)]
        for work in works:
            work.wait()


def parameter_server(buf, p2p: P2P, scratch) -> None:
    if p2p.rank == 0:
        for worker in range(1, p2p.world):
            p2p.recv(scratch, worker)
            buf += scratch
        for worker in range(1, p2p.world):
            p2p.send(buf, worker)
    else:
        p2p.send(buf, 0)
        p2p.recv(buf, 0)


def _masks(world: int) -> list[int]:
    return [1 << i for i in range(math.ceil(math.log2(world)))] if world > 1 else []


def reduce_broadcast(buf, p2p: P2P, scratch) -> None:
    """Binomial tree: at mask m, rank r with bit m set sends to r - m (reduce), then the mirror."""
    rank = p2p.rank
    for mask in _masks(p2p.world):
        if rank % (2 * mask) == mask:
            p2p.send(buf, rank - mask)
            break
        if rank + mask < p2p.world:
            p2p.recv(scratch, rank + mask)
            buf += scratch
    for mask in reversed(_masks(p2p.world)):
        if rank % (2 * mask) == 0 and rank + mask < p2p.world:
            p2p.send(buf, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(buf, rank - mask)


def ring(buf, p2p: P2P, scratch) -> None:
    """N-1 steps of reduce-scatter (rank r ends owning chunk r+1), then N-1 of all-gather."""
    n, rank = p2p.world, p2p.rank
    chunks = buf.tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        outgoing, incoming = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        landing = scratch[:incoming.numel()]
        p2p.exchange(outgoing, right, landing, left)
        incoming += landing
    for step in range(n - 1):
        p2p.exchange(chunks[(rank - step + 1) % n], right, chunks[(rank - step) % n], left)


def halving_doubling(buf, p2p: P2P, scratch) -> None:
    """Rabenseifner: ranks beyond the largest power of two p fold into rank - p first."""
    n, rank = p2p.world, p2p.rank
    p = 1 << (n.bit_length() - 1)
    if rank >= p:
        p2p.send(buf, rank - p)
        p2p.recv(buf, rank - p)
        return
    if rank + p < n:
        p2p.recv(scratch, rank + p)
        buf += scratch
    low, high, splits = 0, buf.numel(), []
    mask = p >> 1
    while mask:  # halving: keep one half of the segment, send the other to the partner
        partner, middle = rank ^ mask, low + (high - low) // 2
        keep, give = ((low, middle), (middle, high)) if rank & mask == 0 else ((middle, high), (low, middle))
        landing = scratch[:keep[1] - keep[0]]
        p2p.exchange(buf[give[0]:give[1]], partner, landing, partner)
        buf[keep[0]:keep[1]] += landing
        splits.append((low, high))
        low, high = keep
        mask >>= 1
    for mask_bit, (parent_low, parent_high) in zip(_masks(p), reversed(splits)):  # doubling
        partner = rank ^ mask_bit
        other = (high, parent_high) if low == parent_low else (parent_low, low)
        p2p.exchange(buf[low:high], partner, buf[other[0]:other[1]], partner)
        low, high = parent_low, parent_high
    if rank + p < n:
        p2p.send(buf, rank + p)


def backend(buf, p2p: P2P, scratch) -> None:
    p2p.dist.all_reduce(buf)


IMPLEMENTATIONS: dict[str, Callable] = {"parameter_server": parameter_server, "reduce_broadcast": reduce_broadcast,
                                        "ring": ring, "halving_doubling": halving_doubling, "backend": backend}


# --------------------------------------------------------------------------- one N, on every rank


def _input(numel: int, rank: int):
    import torch

    # Small integers: every summation order gives the exact same fp32 sum.
    return (torch.arange(numel) % 7 + rank).float()


def check_correct(numel: int, p2p: P2P) -> dict[str, bool]:
    import torch

    expected = sum(_input(numel, r) for r in range(p2p.world))
    scratch = torch.empty(numel)
    verdicts = {}
    for name, fn in IMPLEMENTATIONS.items():
        buf = _input(numel, p2p.rank)
        fn(buf, p2p, scratch)
        verdicts[name] = bool(torch.equal(buf, expected))
    return verdicts


def ping_pong(sizes: list[int], rounds: int, p2p: P2P) -> list[tuple[int, float]]:
    """(bytes, one-way seconds) between ranks 0 and 1, the others idle: the link alone."""
    import torch

    out = []
    for nbytes in sizes:
        buf, times = torch.zeros(max(1, nbytes // 4)), []
        for _ in range(rounds + 1):
            p2p.dist.barrier()
            started = time.perf_counter()
            if p2p.rank == 0:
                p2p.send(buf, 1)
                p2p.recv(buf, 1)
            elif p2p.rank == 1:
                p2p.recv(buf, 0)
                p2p.send(buf, 0)
            times.append((time.perf_counter() - started) / 2)
        out.append((buf.numel() * 4, statistics.median(times[1:])))
    return out


def time_algorithms(sizes: list[int], rounds: int, p2p: P2P) -> dict:
    """Per size and algorithm: median seconds (slowest rank) and rank 0's bytes per call."""
    import torch

    results = {}
    for nbytes in sizes:
        numel = nbytes // 4
        source, scratch = _input(numel, p2p.rank), torch.empty(numel)
        buf = source.clone()
        times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        traffic: dict[str, int] = {}
        for round_index in range(rounds + 1):  # round 0 warms up
            for name, fn in IMPLEMENTATIONS.items():
                buf.copy_(source)
                before = p2p.sent + p2p.received
                p2p.dist.barrier()
                started = time.perf_counter()
                fn(buf, p2p, scratch)
                elapsed = time.perf_counter() - started
                traffic[name] = p2p.sent + p2p.received - before
                if round_index:
                    times[name].append(elapsed)
        medians = torch.tensor([statistics.median(times[name]) for name in IMPLEMENTATIONS], dtype=torch.float64)
        p2p.dist.all_reduce(medians, op=p2p.dist.ReduceOp.MAX)
        results[nbytes] = {name: {"seconds": medians[i].item(), "rank0_bytes": traffic[name]}
                           for i, name in enumerate(IMPLEMENTATIONS)}
    return results


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p2p = P2P()
    sizes = [int(kib) * 1024 for kib in args.sizes_kib.split(",")]
    correct = check_correct(1031, p2p)  # odd size: uneven ring chunks and halving segments
    pings = ping_pong(sizes, args.rounds, p2p)
    timings = time_algorithms(sizes, args.rounds, p2p)
    if p2p.rank == 0:
        alpha, beta = fit_alpha_beta([(1, nbytes, seconds) for nbytes, seconds in pings])
        Path(args.worker_out).write_text(json.dumps({
            "world": p2p.world, "correct": correct, "alpha_s": alpha, "beta_s_per_byte": beta, "ping_pong": pings,
            "timings": {str(k): v for k, v in timings.items()}}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def run_all(args: argparse.Namespace) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for world in (int(n) for n in args.ranks.split(",")):
            out = os.path.join(scratch, f"n{world}.json")
            started = time.perf_counter()
            torchrun(__file__, world, ["--worker-out", out, "--sizes-kib", args.sizes_kib,
                                       "--rounds", str(args.rounds)], check=True)
            print(f"N={world}: {time.perf_counter() - started:.0f} s", flush=True)
            runs.append(json.loads(Path(out).read_text()))
    return {"args": vars(args), "cores": os.cpu_count(), "runs": runs}


def table(results: dict) -> str:
    lines = []
    for run in results["runs"]:
        n, alpha, beta = run["world"], run["alpha_s"], run["beta_s_per_byte"]
        bad = [name for name, ok in run["correct"].items() if not ok]
        bandwidth = f"{1 / beta / 1e9:.2f} GB/s" if beta else "unmeasured (sizes too small)"
        lines.append(f"\nN={n}: alpha {alpha * 1e6:.0f} µs, bandwidth {bandwidth} (ping-pong fit); "
                     f"results exact: {'all' if not bad else 'NOT ' + ', '.join(bad)}")
        lines.append(f"{'size':>9}  {'algorithm':<17}{'measured ms':>12}{'predicted ms':>13}{'meas/pred':>10}"
                     f"{'rank-0 bytes/S':>15}")
        for size, by_name in run["timings"].items():
            nbytes = int(size)
            for name in ALGORITHMS:
                measured = by_name[name]["seconds"]
                predicted = PREDICTORS[name](nbytes, n, alpha, beta)
                moved = by_name[name]["rank0_bytes"] / nbytes if name != "backend" else float("nan")
                lines.append(f"{nbytes / 2**10:>6.0f} KiB  {name:<17}{measured * 1e3:>12.2f}{predicted * 1e3:>13.2f}"
                             f"{measured / predicted if predicted else float('nan'):>10.2f}{moved:>15.2f}")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); wrote the JSON only"
    runs = results["runs"]
    fig, axes = plt.subplots(1, len(runs) + 2, figsize=(4.6 * (len(runs) + 2), 4.3), squeeze=False)
    colors = dict(zip(ALGORITHMS, ("#d62728", "#ff7f0e", "#1f77b4", "#2ca02c", "#7f7f7f")))
    for ax, run in zip(axes[0], runs):
        sizes = [int(s) for s in run["timings"]]
        for name in ALGORITHMS:
            measured = [run["timings"][str(s)][name]["seconds"] * 1e3 for s in sizes]
            predicted = [PREDICTORS[name](s, run["world"], run["alpha_s"], run["beta_s_per_byte"]) * 1e3 for s in sizes]
            ax.loglog([s / 2**20 for s in sizes], measured, "o", color=colors[name], label=f"{name} (measured)")
            ax.loglog([s / 2**20 for s in sizes], predicted, "-", color=colors[name], alpha=0.6)
        ax.set_title(f"N={run['world']}: all-reduce ms (lines: alpha-beta)", fontsize=9)
        ax.set_xlabel("buffer MiB")
    axes[0][0].legend(fontsize=7)
    largest = str(max(int(s) for s in runs[0]["timings"]))
    worlds = [run["world"] for run in runs]
    time_ax, bytes_ax = axes[0][-2], axes[0][-1]
    for size_rank, name in enumerate(ALGORITHMS):
        time_ax.plot(worlds, [run["timings"][largest][name]["seconds"] * 1e3 for run in runs], "o-",
                     color=colors[name], label=name)
        if name != "backend":  # markers shrink so coinciding series stay visible
            bytes_ax.plot(worlds, [run["timings"][largest][name]["rank0_bytes"] / int(largest) for run in runs],
                          "o-", color=colors[name], markersize=11 - 2 * size_rank, label=name)
    time_ax.set_title(f"measured ms at {int(largest) / 2**20:.0f} MiB vs N", fontsize=9)
    bytes_ax.set_title("bytes rank 0 sends + receives, in S", fontsize=9)
    for ax in (time_ax, bytes_ax):
        ax.set_xlabel("ranks N")
        ax.set_xticks(worlds)
        ax.legend(fontsize=7)
    fig.suptitle(f"Gloo on 127.0.0.1, {results['cores']} cores, one thread per rank; points measured "
                 f"(median of {results['args']['rounds']}, slowest rank)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,3,4", help="world sizes, one launch each")
    parser.add_argument("--sizes-kib", default="64,1024,8192,32768", help="buffer sizes (KiB, fp32)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "bench_algorithms"), help="JSON/PNG path without suffix")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    results = run_all(args)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    problem = chart(results, out.with_suffix(".png"))
    print(problem or f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0 if all(all(run["correct"].values()) for run in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
