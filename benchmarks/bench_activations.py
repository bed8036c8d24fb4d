#!/usr/bin/env python3
"""What each activation policy keeps, and what it costs in step time, side by side.

    python benchmarks/bench_activations.py                  # 2 ranks, stage 3, ~1 minute here
    python benchmarks/bench_activations.py --seq-len 512 --layers 8 --rounds 5
    python benchmarks/bench_activations.py --measure-activations --size 10m --stage 0 --micro-batch 1 --rounds 10

Every policy's model is built in the same processes from the same init and stepped
round-robin (``--rounds`` rounds of ``--steps`` steps after one warm-up step each), so
machine drift hits all alike. Per policy: the activation bytes ``memory_report()`` measured
(the most kept on the device and on the host during a step: saved-tensor hooks, each storage
once), the median step time, and both relative to the run without a policy. Results: a table
on rank 0's stdout and ``benchmarks/results/bench_activations.json``. The run without a
policy measures with ``measure_activations=True``.

``--measure-activations`` times instead what counting costs: the same model without a
policy, unmeasured (the default: no saved-tensor hook runs) and with
``measure_activations=True`` (each saved tensor passes a Python pack hook), side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import relaunch, under_launcher  # noqa: E402
from timed import timed_step  # noqa: E402

POLICIES = [
    ("none", {"measure_activations": True}),
    ("full", {"activation_checkpointing": "full"}),
    ("every-k:2", {"activation_checkpointing": "every-k:2"}),
    ("selective:mm", {"activation_checkpointing": "selective:mm"}),
    ("selective:mm/2", {"activation_checkpointing": "selective:mm/2"}),
    ("offload", {"activation_offload": True}),
    ("full + offload", {"activation_checkpointing": "full", "activation_offload": True}),
]
MEASURING = [("unmeasured", {}), ("measured", {"measure_activations": True})]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", default="tiny", help="GPT preset (tiny, 10m, 27m, ...)")
    parser.add_argument("--measure-activations", action="store_true",
                        help="time a run without a policy unmeasured against measure_activations=True")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/bench_activations[_measure].json")
    args = parser.parse_args(argv)
    if args.json is None:
        name = "bench_activations_measure.json" if args.measure_activations else "bench_activations.json"
        args.json = os.path.join(HERE, "results", name)
    return args


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardengine as se
    from shardengine.testing.models import build_gpt, example_inputs, lm_loss

    se.init_distributed()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    vocab = 256
    models = {}
    policies = MEASURING if args.measure_activations else POLICIES
    layers = {"n_layer": args.layers} if args.size == "tiny" else {}
    for name, policy in policies:
        net = build_gpt(args.size, vocab_size=vocab, seq_len=args.seq_len, seed=0, **layers)
        models[name] = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=args.stage, **policy)
    ids, targets = example_inputs(args.micro_batch, args.seq_len, vocab_size=vocab, seed=rank)

    def step(name: str) -> float:
        return timed_step(*models[name], ids, targets, lm_loss)

    times: dict[str, list[float]] = {name: [] for name, _ in policies}
    for name in times:
        step(name)  # warm-up
        models[name][0].memory_report()  # peaks from here
    for _ in range(args.rounds):
        for name in times:
            times[name] += [step(name) for _ in range(args.steps)]
    rows = {}
    for name in times:
        report = models[name][0].memory_report()
        rows[name] = {"peak_activations": report.peak_activations, "peak_host_activations": report.peak_host_activations,
                      "step_s": statistics.median(times[name])}
    if rank == 0 and args.measure_activations:
        print_measuring_cost(args, rows, times, dist.get_world_size())
    elif rank == 0:
        base = rows["none"]
        print(f"stage {args.stage}, {dist.get_world_size()} ranks, {args.layers} blocks, sequence {args.seq_len}, "
              f"micro-batch {args.micro_batch}")
        print(f"{'policy':<16} {'device MiB':>10} {'x none':>7} {'host MiB':>9} {'step s':>8} {'x none':>7}")
        for name, row in rows.items():
            print(f"{name:<16} {row['peak_activations'] / 2**20:>10.2f} "
                  f"{row['peak_activations'] / base['peak_activations']:>7.2f} "
                  f"{row['peak_host_activations'] / 2**20:>9.2f} {row['step_s']:>8.3f} "
                  f"{row['step_s'] / base['step_s']:>7.2f}")
    if rank == 0:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rows": rows}, out, indent=1)
    dist.destroy_process_group()


def print_measuring_cost(args: argparse.Namespace, rows: dict, times: dict, world: int) -> None:
    """Median step time measured / unmeasured, and the same ratio round by round (the spread)."""
    ratio = rows["measured"]["step_s"] / rows["unmeasured"]["step_s"]
    per_round = sorted(m / u for m, u in zip(times["measured"], times["unmeasured"]))
    print(f"{args.size} GPT, stage {args.stage}, {world} ranks, sequence {args.seq_len}, micro-batch "
          f"{args.micro_batch}, {len(per_round)} steps each")
    print(f"unmeasured step {rows['unmeasured']['step_s']:.4f} s (activations {rows['unmeasured']['peak_activations']})")
    print(f"measured   step {rows['measured']['step_s']:.4f} s (peak activations "
          f"{rows['measured']['peak_activations'] / 2**20:.2f} MiB)")
    print(f"measured / unmeasured: {ratio:.3f}x (per step {per_round[0]:.3f}..{per_round[-1]:.3f}, "
          f"median {statistics.median(per_round):.3f})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, 2, argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
