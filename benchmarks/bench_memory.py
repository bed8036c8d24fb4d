"""Per-rank memory by category and bytes per step, each stage, against the ZeRO formulas.

    python benchmarks/bench_memory.py --preset 27m           # launches 2 ranks on CPU itself

For the example GPT at N ranks (fp32, AdamW: 4 bytes of params, 4 of grads, 8 of
optimizer state per parameter) it wraps the model at stages 0-3, takes one step,
and prints ``memory_report()`` per category beside the formula (Ψ = trainable
parameters; the engine pads each flat bucket to a multiple of N, so the table also
gives the ratio), and the bytes this rank sent in one step beside the ring model
for the collectives used (S = 4Ψ). With ``--collectives native`` that is
textbook ZeRO: stages 0-2 2(N-1)/N·S, stage 3 3(N-1)/N·S. With the default
``auto`` on Gloo the reduce-scatter goes out as an all-reduce (see shardengine/distributed/communicator.py),
one (N-1)/N·S more at stages 1-3.

``--shard-group-size K`` (hybrid sharding, stages 1-3): the formulas with N -> K, and the
bytes split by group (``comm_stats().by_group``): in the group of K the stage's
collectives with N -> K, across the G = N/K groups one all-reduce of the reduced shard,
2(G-1)/G·S/K per reduction; stage 0 shards nothing and all-reduces over all N.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import shardengine as se
from shardengine.testing.models import build_gpt, example_inputs, lm_loss
from launch import relaunch, under_launcher  # benchmarks/launch.py

MIB = 2**20
FORMULA = {  # bytes per parameter per rank: (params, grads, optimizer states), N ranks
    0: lambda n: (4, 4, 8), 1: lambda n: (4, 4, 8 / n), 2: lambda n: (4, 4 / n, 8 / n),
    3: lambda n: (4 / n, 4 / n, 8 / n)}


def ring_theory(stage: int, n: int, k: int, in_place: bool, full: float) -> list[float]:
    """Bytes per rank and step by group (in the shard group, across groups, over all ranks)."""
    if stage == 0:
        return [0.0, 0.0, 2 * (n - 1) * full / n]
    groups = n // k
    in_group = ((2 if in_place else 1) + (2 if stage == 3 else 1)) * (k - 1) * full / k
    return [in_group, 2 * (groups - 1) * full / k / groups, 0.0]


def one_stage(stage: int, args) -> dict:
    model = build_gpt(args.preset, vocab_size=args.vocab, seq_len=args.seq_len, seed=0)
    psi = sum(p.numel() for p in model.parameters())
    model, optimizer = se.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage,
                                collectives=args.collectives, shard_group_size=args.shard_group_size)
    in_place = model.engine.comm.in_place_primitives  # read-only look
    idx, targets = example_inputs(args.micro_batch, args.seq_len, vocab_size=args.vocab)
    model.reset_comm_stats()
    lm_loss(model(idx), targets).backward()
    optimizer.step()
    report = model.memory_report()  # between step and zero_grad(), which frees the gradients
    optimizer.zero_grad()
    stats = model.comm_stats()
    n, k = model.world_size, model.shard_group_size
    formula = [round(per * psi) for per in FORMULA[stage](k)]
    theory = ring_theory(stage, n, k, in_place, 4 * psi)
    by_group = [stats.by_group[name].bytes_total for name in ("intra_group", "inter_group", "all_ranks")]
    return {"stage": stage, "psi": psi, "group": k, "measured": [report.params, report.grads, report.optimizer_states],
            "formula": formula, "sent": stats.bytes_total, "theory": sum(theory), "sent_by_group": by_group,
            "theory_by_group": theory}


def render(rows: list[dict], n: int) -> str:
    header = ["stage", "K", "params", "grads", "optim states", "total ratio", "in group", "across groups",
              "all ranks", "sent/theory"]
    widths = [5, 2, 17, 17, 17, 11, 15, 15, 13, 11]
    table = [header]
    for row in rows:
        cells = [f"{m / MIB:.2f} / {f / MIB:.2f}" for m, f in zip(row["measured"], row["formula"])]
        sent = [f"{m / MIB:.2f} / {t / MIB:.2f}" for m, t in zip(row["sent_by_group"], row["theory_by_group"])]
        table.append([str(row["stage"]), str(row["group"]), *cells,
                      f"{sum(row['measured']) / sum(row['formula']):.4f}", *sent,
                      f"{row['sent'] / row['theory']:.4f}"])
    lines = [f"Ψ = {rows[0]['psi']:,} parameters, N = {n}, fp32 AdamW; MiB per rank (measured / formula, "
             "sent per step: measured / ring theory; K: ranks per shard group)"]
    for index, cells in enumerate(table):
        lines.append(" | ".join(cell.rjust(width) for cell, width in zip(cells, widths)))
        if index == 0:
            lines.append("-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="27m", help="GPT preset (shardengine.testing.models)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="ranks, when this script launches torchrun itself")
    p.add_argument("--collectives", default="auto", choices=["auto", "native"],
                   help="shard(collectives=...): 'native' for the textbook ZeRO collectives on Gloo too")
    p.add_argument("--shard-group-size", type=int, default=None,
                   help="hybrid sharding: shard within groups of this many ranks (stages 1-3)")
    p.add_argument("--json", help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    torch.set_num_threads(1)
    se.init_distributed()
    rows = [one_stage(stage, args) for stage in range(4)]
    if se.distributed.is_main_process():
        print(render(rows, se.distributed.world_size()))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
