#!/usr/bin/env python3
"""Train a small GPT with a litgpt-style Lightning Fabric loop on shardengine.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/fabric_gpt.py --stage 3
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/fabric_gpt.py --strategy ddp

The loop is Fabric's (litgpt's pretrain loop, reduced): ``fabric.launch``, ``fabric.setup``,
``fabric.setup_dataloaders``, ``fabric.no_backward_sync`` for gradient accumulation,
``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load`` with a state dict
holding the model, the optimizer and the iteration counter. The only shardengine line is the
strategy: ``--strategy ddp`` runs the very same loop with Fabric's own DDP. ``--resume auto``
continues from ``WORKDIR/checkpoint`` (a sharded directory, loadable at another world size and
stage). The model and the corpus are built locally: nothing is downloaded. Needs
``pip install -e ".[lightning]"``.
"""
from __future__ import annotations

import argparse
import math
import os

import torch
from torch.utils.data import DataLoader

import shardengine as se  # before Lightning creates the process group (see the README)
from data.corpus import CharTokenizer, generate_corpus  # examples/data, next to this script
from data.shares import Windows
from shardengine.testing.models import build_gpt, lm_loss

import lightning as L  # noqa: E402
from shardengine.integrations.lightning import ShardFabricStrategy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["shard", "ddp"], default="shard", help="ddp: Fabric's own DDPStrategy")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (--strategy shard)")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"],
                   help="bf16-mixed: under shard, the engine computes in bf16 with fp32 master weights")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--accumulate", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--workdir", default="fabric_gpt_run", help="the checkpoint goes here")
    p.add_argument("--resume", choices=["no", "auto"], default="no", help="auto: continue from the checkpoint")
    return p.parse_args(argv)


def learning_rate(step: int, steps: int, peak: float) -> float:
    """litgpt's schedule: linear warm-up, then cosine decay to a tenth."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    strategy = ShardFabricStrategy(stage=args.stage) if args.strategy == "shard" else "ddp"
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)), strategy=strategy,
                      precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)

    text = generate_corpus(60_000)
    tokenizer = CharTokenizer(text)
    train = fabric.setup_dataloaders(DataLoader(Windows(tokenizer.encode(text), args.seq_len),
                                                batch_size=args.micro_batch, shuffle=True, drop_last=True))
    net = build_gpt("tiny", vocab_size=tokenizer.vocab_size, seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    checkpoint = os.path.join(args.workdir, "checkpoint")
    if args.resume == "auto" and os.path.exists(checkpoint):
        fabric.load(checkpoint, state)
        fabric.print(f"resumed at step {state['step_count']}")

    batches = iter(train)
    while state["step_count"] < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(state["step_count"], args.steps, args.lr)
        for micro in range(args.accumulate):
            try:
                idx, targets = next(batches)
            except StopIteration:
                batches = iter(train)
                idx, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = lm_loss(model(idx), targets)
                fabric.backward(loss / args.accumulate)
            state["iter_num"] += 1
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step_count"] += 1
        if state["step_count"] % 5 == 0 or state["step_count"] == args.steps:
            fabric.print(f"step {state['step_count']:3d}  loss {loss.item():.4f}  grad norm {float(norm):.3f}")
    fabric.save(checkpoint, state)
    fabric.print(f"saved {checkpoint}")


if __name__ == "__main__":
    main()
