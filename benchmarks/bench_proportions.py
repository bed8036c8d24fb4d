#!/usr/bin/env python3
"""Equal vs automatic proportions with one rank slowed: step time side by side.

    python benchmarks/bench_proportions.py                     # launches torchrun itself (N=2)
    python benchmarks/bench_proportions.py --slow-factor 3 --rounds 12

Both configurations train the example's GPT (``examples/train_gpt.py``: same
init, same global micro-batch of ``--micro-batch`` x ranks from
``ProportionalSampler``) in the same processes, with rank ``--slow-rank``
sleeping so that its forward and backward take ``--slow-factor`` times as long
(the example's ``--slow-rank``). ``equal`` keeps shares 1/N; ``auto`` first
runs the example's tuner (``--auto-rounds`` measurements of ``--auto-window``
steps, untimed), then both are timed round-robin: ``--rounds`` rounds of
``--steps`` steps each, every step between two barriers (so it is the slowest
rank's time). Rank 0 prints a table: median step time and IQR, the shares and
micro-batches, each rank's mean work per step, and the ratio equal / auto: of
the medians, and the median and range of the per-round ratios (paired rounds
resist the machine's load changing during the run).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardengine as se  # noqa: E402
import train_gpt  # noqa: E402
from data.corpus import load_corpus  # noqa: E402
from data.shares import UnevenData, slashed  # noqa: E402
from shardengine.distributed.launch import all_gather_object_default_group  # noqa: E402
from launch import relaunch, under_launcher  # benchmarks/launch.py


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks, when this script launches torchrun itself")
    p.add_argument("--preset", default="1m")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=16, help="mean sequences per rank (global = this x ranks)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--auto-window", type=int, default=4)
    p.add_argument("--auto-rounds", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    return p.parse_args(argv)


class Config:
    """One configuration: a model, its optimizer and its uneven-data stream."""

    def __init__(self, name: str, args, vocab_size: int, train_data, info) -> None:
        self.name, self.info = name, info
        example = train_gpt.parse_args(["--preset", args.preset, "--stage", str(args.stage), "--micro-batch",
                                        str(args.micro_batch), "--seq-len", str(args.seq_len), "--warmup", "1"])
        self.model, self.optimizer, _ = train_gpt.make_model_and_optimizer(example, vocab_size, info.device)
        proportions = "auto" if name == "auto" else [1 / info.world_size] * info.world_size
        self.data = UnevenData(train_data, args.seq_len, args.micro_batch * info.world_size, proportions,
                               seed=0, auto_window=args.auto_window, auto_rounds=args.auto_rounds)
        self.slow = args.slow_factor if info.rank == args.slow_rank else 1.0
        self.step_s: list[float] = []
        self.work_s: list[float] = []

    def step(self) -> tuple[float, float]:
        batch = tuple(t.to(self.info.device) for t in self.data.next())
        dist.barrier()
        started = time.perf_counter()
        _, _, work = train_gpt.train_step(self.model, self.optimizer, [batch], clip=1.0, slow_factor=self.slow)
        dist.barrier()
        return time.perf_counter() - started, work


def tune(config: Config) -> None:
    step = 0
    while config.data.tuner is not None and not config.data.tuner.done:
        step += 1
        _, work = config.step()
        line = config.data.after_step(step, work)
        if line and se.distributed.is_main_process():
            print(f"auto: {line}", flush=True)


def main() -> int:
    args = parse_args()
    if not under_launcher():
        return relaunch(__file__, args.nproc)
    info = se.init_distributed()
    torch.set_num_threads(1)
    tok, train_data, _ = load_corpus()
    configs = [Config(name, args, tok.vocab_size, train_data, info) for name in ("equal", "auto")]
    for config in configs:  # untimed: warm-up (equal) and the tuner's measurements (auto)
        config.step()
        tune(config)
    per_round: dict[str, list[float]] = {c.name: [] for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            times = [config.step() for _ in range(args.steps)]
            config.step_s += [t for t, _ in times]
            config.work_s += [w for _, w in times]
            per_round[config.name].append(statistics.median(t for t, _ in times))
    report = [(c.name, c.step_s, statistics.mean(c.work_s), c.data.batches.proportions, c.data.batches.sizes)
              for c in configs]
    ranks = all_gather_object_default_group([(name, work) for name, _, work, _, _ in report])
    if se.distributed.is_main_process():
        print_table(args, report, ranks, per_round)
    dist.destroy_process_group()
    return 0


def print_table(args, report, ranks, per_round) -> None:
    print(f"\n{args.nproc} ranks, preset {args.preset}, stage {args.stage}, global micro-batch "
          f"{args.micro_batch * args.nproc} x {args.seq_len} tokens, rank {args.slow_rank} slowed x{args.slow_factor}; "
          f"{args.rounds} rounds x {args.steps} steps each, round-robin")
    print(f"{'config':>7}  {'median ms/step':>14}  {'IQR ms':>13}  {'shares':>13}  {'micro-batches':>13}  "
          f"{'work ms/step by rank':>20}")
    medians = {}
    for i, (name, steps, _, shares, sizes) in enumerate(report):
        q1, median, q3 = statistics.quantiles(steps, n=4)
        medians[name] = median
        work = slashed([rank[i][1] * 1e3 for rank in ranks], ".1f")
        print(f"{name:>7}  {median * 1e3:14.1f}  {q1 * 1e3:6.1f}-{q3 * 1e3:6.1f}  {slashed(shares, '.3f'):>13}  "
              f"{slashed(sizes, 'd'):>13}  {work:>20}")
    paired = [e / a for e, a in zip(per_round["equal"], per_round["auto"])]
    print(f"equal / auto: {medians['equal'] / medians['auto']:.2f}x of the medians; per round "
          f"(median step of each, paired): median {statistics.median(paired):.2f}x, range "
          f"{min(paired):.2f}-{max(paired):.2f}")


if __name__ == "__main__":
    sys.exit(main())
