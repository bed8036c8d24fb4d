#!/usr/bin/env python3
"""Every ``compression=`` option training the example GPT, side by side.

    python benchmarks/bench_compression_training.py                 # launches 2 CPU ranks itself
    python benchmarks/bench_compression_training.py --steps 300 --configs s0,s0-int8

The model, data and optimizer of ``examples/train_gpt.py`` (``build_gpt(preset)``,
the generated character corpus, AdamW with warm-up and clipping at 1.0; here the
learning rate decays to 10% by a cosine over the run). Every
configuration lives in the same processes, starts from the same weights and
sees the same batches in the same order; the steps go round-robin over the
configurations (one step each per round), so machine drift hits all alike.
Per configuration: MiB each rank sends per step (``comm_stats()``, checked
against ``ring_model_bytes()``), the median step time and its ratio to the
uncompressed configuration of the same stage (medians of the same rounds),
the validation loss after the last step and its deviation from that
uncompressed run, and the training-loss curve. Rank 0 prints the table and
writes ``benchmarks/results/bench_compression_training.json`` and ``.png``
(loss curves and bytes per option; needs matplotlib).

On loopback Gloo the "link" is memory, so compression saves bytes but rarely
time here (``bench_compression.py`` gives the break-even bandwidths); what this
measures is what each option costs in step time and in training quality.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardengine as se  # noqa: E402
from data.corpus import get_batch, load_corpus  # noqa: E402
from shardengine.distributed.traffic import ring_bytes  # noqa: E402
from shardengine.testing.models import build_gpt, lm_loss  # noqa: E402
from launch import relaunch, under_launcher  # benchmarks/launch.py

RESULTS = ROOT / "benchmarks" / "results"
MB = 2**20
# name -> (stage, compression); the first of each stage is its uncompressed reference
CONFIGS = {
    "s0": (0, None), "s0-bf16": (0, "bf16"), "s0-int8": (0, "int8"),
    "s0-powersgd4": (0, {"grads": "powersgd", "powersgd_rank": 4}),
    "s2": (2, None), "s2-bf16": (2, "bf16"), "s2-int8": (2, "int8"),
    "s3": (3, None), "s3-int8": (3, {"grads": "int8", "params": "int8"}),
    "s3-int8-params": (3, {"params": "int8"}),
}


class Run:
    """One configuration: its model, optimizer, batches and measurements."""

    def __init__(self, name: str, args: argparse.Namespace, vocab: int):
        self.name = name
        self.stage, compression = CONFIGS[name]
        self.reference = next(n for n, (s, c) in CONFIGS.items() if s == self.stage and c is None)
        net = build_gpt(args.preset, vocab_size=vocab, seq_len=args.seq_len, seed=0)
        adamw = functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.model, self.optimizer = se.shard(net, adamw, stage=self.stage, compression=compression)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(
            _learning_rate_factor, warmup=args.warmup, steps=args.steps))
        self.batches = torch.Generator().manual_seed(1000 + dist.get_rank())  # same data for every config
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def step(self, train: torch.Tensor, args: argparse.Namespace, timed: bool) -> None:
        idx, targets = get_batch(train, args.micro_batch, args.seq_len, self.batches)
        dist.barrier()
        started = time.perf_counter()
        loss = lm_loss(self.model(idx), targets)
        loss.backward()
        self.model.clip_grad_norm_(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        dist.barrier()
        if timed:
            self.seconds.append(time.perf_counter() - started)
        self.schedule.step()
        self.losses.append(_mean_over_ranks(loss))

    @torch.no_grad()
    def validation_loss(self, val: torch.Tensor, args: argparse.Namespace) -> float:
        gen = torch.Generator().manual_seed(10_000 + dist.get_rank())
        losses = [lm_loss(self.model(x), y) for x, y in
                  (get_batch(val, args.micro_batch, args.seq_len, gen) for _ in range(args.eval_batches))]
        return _mean_over_ranks(torch.stack(losses).mean())


def _learning_rate_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10%: the last steps are small, so the validation loss
    after them measures the run rather than the noise of its last few updates."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone().reshape(1)
    dist.all_reduce(value)  # outside the engine's counters: logging only
    return value.item() / dist.get_world_size()


def train_all(runs: list[Run], train: torch.Tensor, args: argparse.Namespace) -> None:
    for run in runs:  # warm-up steps, untimed, then count bytes from zero
        for _ in range(args.warmup_steps):
            run.step(train, args, timed=False)
        run.model.reset_comm_stats()
    for round_index in range(args.steps - args.warmup_steps):
        for run in runs:
            run.step(train, args, timed=True)
        if dist.get_rank() == 0 and (round_index + 1) % 50 == 0:
            print(f"   round {round_index + 1}/{args.steps - args.warmup_steps}", flush=True)


def summarize(runs: list[Run], val: torch.Tensor, args: argparse.Namespace) -> list[dict]:
    timed = args.steps - args.warmup_steps
    rows = []
    for run in runs:
        stats = run.model.comm_stats()
        clip = ring_bytes("all_reduce", 4, dist.get_world_size()) if run.stage else 0  # the norm's fp32 scalar
        sent = stats.bytes_total / timed
        rows.append({"config": run.name, "stage": run.stage, "reference": run.reference,
                     "mib_per_step": sent / MB, "ring_model_mib": run.model.ring_model_bytes() / MB,
                     "counters_match_ring_model": stats.bytes_total == timed * (run.model.ring_model_bytes() + clip),
                     "bytes_by_kind": {k: v / timed for k, v in stats.bytes_by_kind.items()},
                     "median_step_s": statistics.median(run.seconds),
                     "step_s": run.seconds, "losses": run.losses,
                     "val_loss": run.validation_loss(val, args)})
    by_name = {row["config"]: row for row in rows}
    for row in rows:
        ref = by_name.get(row["reference"])
        if ref is None:
            continue
        row["bytes_ratio"] = row["mib_per_step"] / ref["mib_per_step"]
        row["time_ratio"] = row["median_step_s"] / ref["median_step_s"]
        row["paired_time_ratio"] = statistics.median(a / b for a, b in zip(row["step_s"], ref["step_s"]))
        row["val_loss_delta_pct"] = 100 * (row["val_loss"] / ref["val_loss"] - 1)
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nGPT {args.preset}, N={dist.get_world_size()} gloo, {args.steps} steps ({args.warmup_steps} untimed), "
          f"micro-batch {args.micro_batch} x {args.seq_len}; ratios against the same stage uncompressed")
    print(f"{'config':>15} | {'MiB/step':>8} | {'bytes':>5} | {'step ms':>7} | {'time':>5} | {'paired':>6} | "
          f"{'val loss':>8} | {'vs ref':>7}")
    for r in rows:
        print(f"{r['config']:>15} | {r['mib_per_step']:8.3f} | {r.get('bytes_ratio', 1):5.3f} | "
              f"{r['median_step_s'] * 1e3:7.1f} | {r.get('time_ratio', 1):5.2f} | {r.get('paired_time_ratio', 1):6.2f} | "
              f"{r['val_loss']:8.4f} | {r.get('val_loss_delta_pct', 0):+6.2f}%")
    for r in rows:
        if not r["counters_match_ring_model"]:
            print(f"MISS  {r['config']}: comm_stats() differs from ring_model_bytes() + the clipping scalar")
        name = r["config"]
        if ("bf16" in name or name.endswith("int8")) and "val_loss_delta_pct" in r and r["config"] != r["reference"]:
            verdict = "PASS" if abs(r["val_loss_delta_pct"]) <= 1.0 else "MISS"
            print(f"{verdict}  {name}: validation loss within 1% of {r['reference']} "
                  f"({r['val_loss_delta_pct']:+.2f}%)")


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (curves, sent) = plt.subplots(1, 2, figsize=(13, 5))
    window = 10
    for row in rows:
        losses = row["losses"]
        smooth = [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
        curves.plot(smooth, label=row["config"], linestyle="-" if row["config"] == row["reference"] else "--")
    curves.set(xlabel="step", ylabel=f"training loss (mean of {window} steps)", title="loss curves")
    curves.legend(fontsize=8)
    names = [row["config"] for row in rows]
    sent.barh(names, [row["mib_per_step"] for row in rows])
    sent.invert_yaxis()
    sent.set(xlabel="MiB sent per rank per step", title="bytes per option")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma separated: " + ",".join(CONFIGS))
    parser.add_argument("--preset", default="1m", help="GPT preset (examples/train_gpt.py)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per configuration")
    parser.add_argument("--warmup-steps", type=int, default=5, help="of those, untimed at the start")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=10, help="learning-rate warm-up steps")
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, when this script launches torchrun itself")
    parser.add_argument("--out", default=str(RESULTS / "bench_compression_training"), help="JSON/PNG path without suffix")
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    se.init_distributed()
    tokenizer, train, val = load_corpus()
    missing_refs = {CONFIGS[n][0] for n in names} - {CONFIGS[n][0] for n in names if CONFIGS[n][1] is None}
    if missing_refs:
        parser.error(f"stage(s) {sorted(missing_refs)} lack their uncompressed configuration (s<stage>)")
    started = time.time()
    runs = [Run(name, args, tokenizer.vocab_size) for name in names]
    train_all(runs, train, args)
    rows = summarize(runs, val, args)
    if dist.get_rank() == 0:
        print_table(rows, args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        drew = plot(rows, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.json')}" + (f" and {out.with_suffix('.png')}" if drew else
                                                       " (no matplotlib: no plot)"))
        print(f"total {time.time() - started:.0f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
