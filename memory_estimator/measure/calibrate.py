"""``memory-estimator calibrate``: measure this machine's alpha, beta and compute rates, and store them.

    memory-estimator calibrate                       # 2 ranks on this machine, ~20 s
    memory-estimator calibrate --nproc 4 --rounds 9 --out /tmp/calibration.json

It launches ``--nproc`` ranks under torchrun (Gloo on CPU, NCCL on GPUs) and, with
every rank busy at once as in training, times:

* the engine's own collectives (``shardengine.distributed.communicator.Communicator``, so on Gloo the
  all-gather is broadcasts, as the engine issues it): all-reduce and all-gather at
  ``--sizes-kib``, round-robin, each between barriers, the slowest rank's median; then
  ``seconds = steps x alpha + bytes sent x beta`` is fitted over all of them;
* a large fp32 matmul (the device's peak) and forward+backward of a small GPT (the
  achieved rate, with the time model's FLOP count: their ratio is the default efficiency);
* AdamW's step over a flat buffer (bytes touched per second);
* one all-reduce running while the rank computes: the fraction of it hidden (overlap).

Rank 0 stores the result (see :mod:`memory_estimator.hardware.calibration` for where) and prints it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import shardengine as se
from shardengine.distributed.communicator import Communicator
from shardengine.testing.models import GPT, GPTConfig, example_inputs, lm_loss

from ..hardware.calibration import Calibration, calibration_path, fit_alpha_beta, save_calibration
from ..timing.collectives import latency_steps

KINDS = ("all_reduce", "all_gather")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="memory-estimator calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch on this machine (default 2)")
    parser.add_argument("--sizes-kib", default="16,256,4096,32768", help="collective buffer sizes (KiB, fp32)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per size (median kept)")
    parser.add_argument("--hidden", type=int, default=384, help="width of the GPT timed for the achieved rate")
    parser.add_argument("--seq-len", type=int, default=256, help="its sequence length")
    parser.add_argument("--out", default=None, help=f"where to store it (default {calibration_path()})")
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.rounds < 1:
        parser.error("need --nproc >= 2 (collectives need peers) and --rounds >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return _launch(args, argv)
    calibration = measure([int(size) * 1024 for size in args.sizes_kib.split(",")], args.rounds, args.hidden,
                          args.seq_len)
    if calibration is not None:
        path = save_calibration(calibration, Path(args.out) if args.out else None)
        print(describe(calibration) + f"\nstored in {path}", flush=True)
    return 0


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this module under torchrun, ``--nproc`` ranks on this machine."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # the ranks need no --nproc (torchrun gives the world); torchrun would read it as an abbreviation
    # of its own --nproc-per-node, ambiguous with --nproc_per_node, and refuse the command line
    forwarded = [arg for i, arg in enumerate(argv) if not (arg.startswith("--nproc") or
                                                           (i and argv[i - 1] == "--nproc"))]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "memory_estimator.measure.calibrate", *forwarded]
    return subprocess.call(command, env=env)


def describe(c: Calibration) -> str:
    return (f"{c.backend}, {c.world_size} ranks on {c.host}: alpha {c.alpha_s * 1e6:.1f} µs, "
            f"bandwidth {c.bandwidth_bytes_per_s / 1e9:.3g} GB/s per rank; matmul {c.matmul_flops / 1e9:.3g} "
            f"GFLOP/s, GPT forward+backward {c.training_flops / 1e9:.3g} GFLOP/s (efficiency "
            f"{c.compute_efficiency:.2f}); AdamW step {c.optimizer_bytes_per_s / 1e9:.3g} GB/s; "
            f"overlap {c.overlap:.2f}")


# --------------------------------------------------------------------------- on every rank


def measure(sizes_bytes: Sequence[int], rounds: int = 7, hidden: int = 384, seq_len: int = 256
            ) -> Optional[Calibration]:
    """Every rank measures (collectives of ``sizes_bytes``, ``rounds`` each; a GPT of width ``hidden``
    over ``seq_len`` tokens for the achieved rate); rank 0 gets the Calibration (the others None)."""
    import torch

    info = se.init_distributed()
    if info.device.type == "cpu":
        torch.set_num_threads(1)
    comm = Communicator.create()
    sync = _synchronizer(info.device)
    barrier = lambda: comm.all_reduce(torch.zeros(1, device=info.device))  # noqa: E731
    samples = _collective_samples(comm, list(sizes_bytes), rounds, info.device, barrier, sync)
    alpha, beta = _alpha_beta(comm, samples)
    matmul = _mean(comm, _matmul_flops(info.device, sync, barrier))
    training = _mean(comm, _training_flops(hidden, seq_len, info.device, sync, barrier))
    optimizer = _mean(comm, _optimizer_bytes_per_s(info.device, sync, barrier))
    overlap = _mean(comm, _overlap(comm, info.device, sync, barrier))
    if comm.rank != 0:
        return None
    return Calibration(backend=comm.backend, world_size=comm.world_size, alpha_s=alpha, beta_s_per_byte=beta,
                       matmul_flops=matmul, training_flops=training, optimizer_bytes_per_s=optimizer,
                       overlap=overlap, torch_version=torch.__version__,
                       samples=tuple((kind, comm.world_size, full, seconds) for kind, _, full, seconds in samples))


def _alpha_beta(comm, samples) -> tuple[float, float]:
    """The least-squares fit; when noise leaves no slope (beta 0: the larger buffers were not
    slower), beta from the largest buffers alone, alpha kept: a link is never infinitely fast."""
    alpha, beta = fit_alpha_beta([(latency_steps(_issued(comm, kind), comm.world_size), sent, seconds)
                                  for kind, sent, _, seconds in samples])
    if beta > 0:
        return alpha, beta
    largest = max(full for _, _, full, _ in samples)
    return alpha, statistics.median(seconds / sent for _, sent, full, seconds in samples if full == largest)


def _synchronizer(device) -> Callable[[], None]:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _issued(comm, kind: str) -> str:
    """What the communicator sends for ``kind`` (Gloo's all-gather is broadcasts)."""
    return "broadcast" if kind == "all_gather" and comm.in_place_primitives else kind


def _timed(fn: Callable[[], None], sync, barrier) -> float:
    barrier()
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def _slowest(comm, values: list[float]) -> list[float]:
    import torch

    tensor = torch.tensor(values, dtype=torch.float64)
    comm.all_reduce_max(tensor)
    return tensor.tolist()


def _mean(comm, value: float) -> float:
    import torch

    tensor = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(tensor)
    return tensor.item() / comm.world_size


def _collective_samples(comm, sizes: list[int], rounds: int, device, barrier, sync):
    """(kind, bytes sent per rank, full bytes, slowest rank's median seconds) per kind and size."""
    import torch

    n = comm.world_size
    buffers = {size: torch.randn(size // 4 // n * n, device=device) for size in sizes}
    cases = [(kind, size) for size in sizes for kind in KINDS]
    ops = {"all_reduce": lambda full: comm.all_reduce(full),
           "all_gather": lambda full: comm.all_gather(full, full.chunk(n)[comm.rank])}
    times: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    for round_index in range(rounds + 1):  # the first round warms up
        for kind, size in cases:
            seconds = _timed(lambda: ops[kind](buffers[size]), sync, barrier)
            if round_index:
                times[(kind, size)].append(seconds)
    medians = _slowest(comm, [statistics.median(times[case]) for case in cases])
    return [(kind, comm.bytes_sent(kind, buffers[size].numel() * 4), buffers[size].numel() * 4, seconds)
            for (kind, size), seconds in zip(cases, medians)]


def _repeat_for(fn: Callable[[], None], sync, barrier, seconds: float = 0.3) -> tuple[int, float]:
    """Calls of ``fn`` that take about ``seconds``, and the time they took (every rank at once)."""
    fn()
    once = max(_timed(fn, sync, barrier), 1e-6)
    repeats = max(1, int(seconds / once))
    return repeats, _timed(lambda: [fn() for _ in range(repeats)], sync, barrier)


def _matmul_flops(device, sync, barrier) -> float:
    import torch

    a, b = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    repeats, seconds = _repeat_for(lambda: a @ b, sync, barrier)
    return 2 * 1024**3 * repeats / seconds


def _training_flops(hidden: int, seq_len: int, device, sync, barrier) -> float:
    """A 2-layer GPT's forward+backward, counted as the time model counts FLOPs."""
    import torch

    from ..timing.step import Workload, forward_flops

    heads = max(1, hidden // 64)
    config = GPTConfig(vocab_size=256, seq_len=seq_len, n_layer=2, n_head=heads, n_embd=hidden)
    model = GPT(config).to(device)
    idx, targets = (t.to(device) for t in example_inputs(1, seq_len, 256))

    def step() -> None:
        lm_loss(model(idx), targets).backward()
        model.zero_grad(set_to_none=True)

    repeats, seconds = _repeat_for(step, sync, barrier)
    params = sum(p.numel() for p in model.parameters())
    workload = Workload(params, seq_len, layers=2, hidden=hidden, seq_len=seq_len, precision="fp32")
    return 3 * forward_flops(workload) * repeats / seconds


def _optimizer_bytes_per_s(device, sync, barrier, numel: int = 1 << 22) -> float:
    import torch

    from ..timing.step import STEP_BYTES

    param = torch.nn.Parameter(torch.randn(numel, device=device))
    param.grad = torch.randn(numel, device=device)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    repeats, seconds = _repeat_for(optimizer.step, sync, barrier)
    return STEP_BYTES["adamw"] * numel * repeats / seconds


def _overlap(comm, device, sync, barrier) -> float:
    """Fraction of an all-reduce hidden when it runs while this rank computes."""
    import torch

    a = torch.randn(512, 512, device=device)
    buffer = torch.randn(4 << 20, device=device)  # 16 MiB
    alone = _timed(lambda: comm.all_reduce(buffer), sync, barrier)
    repeats = max(1, int(alone / max(_timed(lambda: a @ a, sync, barrier), 1e-6)))
    compute = _timed(lambda: [a @ a for _ in range(repeats)], sync, barrier)

    def both() -> None:
        work = comm.all_reduce(buffer, async_op=True)
        for _ in range(repeats):
            a @ a
        work.wait()

    together = _timed(both, sync, barrier)
    hidden = alone + compute - together
    return float(min(1.0, max(0.0, hidden / min(alone, compute))))


if __name__ == "__main__":
    sys.exit(main())
