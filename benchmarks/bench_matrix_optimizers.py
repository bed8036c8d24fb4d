#!/usr/bin/env python3
"""Muon's optimizer step: replicated (stage 0) against owners only (stages 1-3), N = 1, 2, 4.

    python benchmarks/bench_matrix_optimizers.py                 # step times, launches torchrun per N
    python benchmarks/bench_matrix_optimizers.py --layout        # bytes and memory balance (no processes)

**Step times.** A stack of ``--layers`` square ``--dim`` x ``--dim`` linear layers
(no biases) trained with ``torch.optim.Muon``: Newton-Schulz (5 iterations of 3
matmuls on each whole matrix) dominates the step. Every stage of one N lives in
the same processes and the timed steps go round-robin over them, so machine
drift hits all alike. Per stage: the median time of ``optimizer.step()`` between
two barriers (the slowest rank: the engine's gradient agreement, the owners'
Muon step and the parameter all-gather of stages 1-2), and the median time
inside Muon itself on the busiest rank (the Newton-Schulz work). At stage 0
every rank orthogonalizes every matrix; at stages 1-3 each matrix's owner alone,
so the goal is ~1/N of stage 0 plus the all-gather.

**Layout** (``--layout``): for the example GPT (shardengine/models.py) and a
Llama-shaped model (grouped-query attention, gated MLP), built on the meta
device and split by ``se.optim.muon_with_adamw``, the buckets the engine plans at
stages 1-3 for N = 2, 4, 8: the padded elements the collectives move with the
owner layout against the element-sharded layout (the ring-model bytes scale
with them), and the per-rank fp32 model-state bytes (parameters, gradients,
Muon momentum 4 B and AdamW moments 8 B per owned element): largest rank
against the mean.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import shardengine as se  # noqa: E402
from launch import torchrun  # benchmarks/launch.py

STAGES = (0, 1, 2, 3)


# =========================================================================== step times


class Stack(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class MuonTimer:
    """Seconds spent inside the Muon member's own step (Newton-Schulz and the update)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.seconds = 0.0
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "_t0", time.perf_counter()))
        optimizer.register_step_post_hook(lambda *_: setattr(self, "seconds",
                                                             self.seconds + time.perf_counter() - self._t0))


def child(args) -> None:
    torch.set_num_threads(1)
    info = se.init_distributed()
    rank, world = info.rank, info.world_size
    runs = {}
    for stage in STAGES:
        torch.manual_seed(0)
        net = Stack(args.dim, args.layers)
        model, opt = se.shard(net, torch.optim.Muon(net.parameters(), lr=0.02), stage=stage)
        runs[stage] = (model, opt, MuonTimer(opt))
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    times = {stage: [] for stage in STAGES}
    inside = {stage: [] for stage in STAGES}
    for round_ in range(args.warmup + args.rounds):
        for stage, (model, opt, timer) in runs.items():
            model(x).pow(2).mean().backward()
            timer.seconds = 0.0
            torch.distributed.barrier()
            start = time.perf_counter()
            opt.step()
            torch.distributed.barrier()
            elapsed = time.perf_counter() - start
            opt.zero_grad()
            if round_ >= args.warmup:
                times[stage].append(elapsed)
                inside[stage].append(timer.seconds)
    busiest = [None]
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, {s: statistics.median(v) for s, v in inside.items()})
    busiest = {s: max(g[s] for g in gathered) for s in STAGES}
    if rank == 0:
        result = {"world": world, "step_s": {s: statistics.median(v) for s, v in times.items()},
                  "muon_s_busiest_rank": busiest,
                  "comm_bytes_per_step": {s: runs[s][0].ring_model_bytes(1) for s in STAGES}}
        Path(args.out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def run_worlds(args) -> None:
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        out = Path(args.results) / f"bench_matrix_optimizers_N{world}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        torchrun(__file__, world, ["--child", "--out", str(out), "--dim", str(args.dim),
                                   "--layers", str(args.layers), "--batch", str(args.batch),
                                   "--rounds", str(args.rounds), "--warmup", str(args.warmup)],
                 env={"PYTHONPATH": str(ROOT)}, check=True)
        rows.append(json.loads(out.read_text()))
    print(f"\nMuon step, {args.layers} matrices of {args.dim}x{args.dim}, median of {args.rounds} rounds "
          f"(torch threads per rank: 1, {os.cpu_count()} CPUs)")
    print(f"{'N':>3} {'stage':>5} {'step ms':>9} {'vs s0':>6} {'Muon ms (busiest rank)':>23} {'vs s0':>6} "
          f"{'sent MB/step':>13}")
    for row in rows:
        step, muon = row["step_s"], row["muon_s_busiest_rank"]
        for stage in map(str, STAGES):
            print(f"{row['world']:>3} {stage:>5} {1e3 * step[stage]:>9.1f} {step[stage] / step['0']:>6.2f} "
                  f"{1e3 * muon[stage]:>23.1f} {muon[stage] / muon['0']:>6.2f} "
                  f"{row['comm_bytes_per_step'][stage] / 1e6:>13.2f}")


# =========================================================================== layout figures


class LlamaShaped(nn.Module):
    """Embedding, blocks of q/k/v/o (grouped-query) and gate/up/down, RMS norms, untied head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        kv = dim // heads * kv_heads
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            for name, (i, o) in {"q_proj": (dim, dim), "k_proj": (dim, kv), "v_proj": (dim, kv),
                                 "o_proj": (dim, dim), "gate_proj": (dim, ffn), "up_proj": (dim, ffn),
                                 "down_proj": (ffn, dim)}.items():
                setattr(block, name, nn.Linear(i, o, bias=False))
            block.input_layernorm = nn.RMSNorm(dim)
            block.post_attention_layernorm = nn.RMSNorm(dim)
            self.layers.append(block)
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)


def layout_models() -> dict:
    from shardengine.testing.models import build_gpt
    with torch.device("meta"):
        return {"GPT '100m' (shardengine.models)": build_gpt("100m", vocab_size=50304),
                "Llama-shaped (dim 2048, 16 layers, GQA 32/8, ffn 5632)":
                    LlamaShaped(32000, 2048, 16, 32, 8, 5632)}


def bucket_figures(model: nn.Module, stage: int, world: int, owner: bool) -> dict:
    """Padded elements moved, and fp32 model-state bytes per rank, for one layout choice."""
    from shardengine.optim.rebuild import group_index_of
    from shardengine.flat.plan import plan_replicated_buckets, plan_unit_buckets
    from shardengine.optim.whole_tensor import BucketLayouts, whole_tensor_groups

    opts = se.optim.muon_with_adamw(model)
    group_of, whole = group_index_of(opts), whole_tensor_groups(opts, ())
    if stage < 3:
        plans = plan_replicated_buckets(model, group_of, int(25 * 2**20), whole if owner else frozenset(), world)
    else:
        plans = [plan for _, _, unit_plans in plan_unit_buckets(model, group_of, None, None) for plan in unit_plans]
    layouts = BucketLayouts(world)
    padded, per_rank = 0, [0] * world
    for plan in plans:
        is_whole = owner and plan.group_index in whole
        layout = layouts.layout([tuple(p.shape) for p in plan.params], is_whole, steps_whole=False)
        padded += layout.padded_numel
        state_bytes = 4 if plan.group_index in whole else 8  # Muon momentum / AdamW's two moments
        for rank in range(world):
            owned = sum(f.numel for f in layout.fragments(rank))
            replicated = layout.padded_numel if stage < 3 else layout.shard_numel  # params
            grads = layout.padded_numel if stage < 2 else layout.shard_numel
            per_rank[rank] += 4 * (replicated + grads) + state_bytes * owned
    return {"padded": padded, "per_rank": per_rank}


def layout_report(worlds: list[int]) -> None:
    for name, model in layout_models().items():
        total = sum(p.numel() for p in model.parameters())
        print(f"\n{name}: {total / 1e6:.1f} M parameters; Muon + AdamW (se.optim.muon_with_adamw)")
        print(f"{'stage':>5} {'N':>3} {'moved vs element-sharded':>25} {'model-state GB/rank max':>24} "
              f"{'mean':>7} {'max/mean':>9} {'(element-sharded max/mean)':>27}")
        for stage in (1, 2, 3):
            for world in worlds:
                own = bucket_figures(model, stage, world, owner=True)
                elem = bucket_figures(model, stage, world, owner=False)
                mean = statistics.mean(own["per_rank"])
                print(f"{stage:>5} {world:>3} {own['padded'] / elem['padded']:>25.4f} "
                      f"{max(own['per_rank']) / 1e9:>24.3f} {mean / 1e9:>7.3f} {max(own['per_rank']) / mean:>9.4f} "
                      f"{max(elem['per_rank']) / statistics.mean(elem['per_rank']):>27.4f}")


# =========================================================================== entry


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--layout", action="store_true", help="bytes and memory balance only (no processes)")
    parser.add_argument("--layout-worlds", default="2,4,8")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
    elif args.layout:
        layout_report([int(w) for w in args.layout_worlds.split(",")])
    else:
        run_worlds(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
