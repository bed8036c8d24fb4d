#!/usr/bin/env python3
"""Train a small GPT with PyTorch Lightning on shardengine: ``strategy=ShardStrategy(stage=...)``.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/lightning_gpt.py
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/lightning_gpt.py \\
        --stage 3 --precision bf16-mixed --resume auto

The LightningModule is ordinary Lightning code (``self.log``, ``configure_optimizers`` with an
LR scheduler); the only shardengine line is the strategy. The run uses gradient accumulation,
gradient clipping by the global norm, a validation loop, and ``ModelCheckpoint`` writing sharded
checkpoints (``--resume auto`` continues from the newest with ``ckpt_path=``). At the end rank 0
consolidates the last checkpoint into one ``.ckpt`` file and reloads it with
``load_from_checkpoint``, with no process group. The model and the corpus are built locally:
nothing is downloaded. Needs ``pip install -e ".[lightning]"``.
"""
from __future__ import annotations

import argparse
import glob
import os

import torch
from torch.utils.data import DataLoader

import shardengine as se  # before Lightning creates the process group (see the README)
from data.corpus import CharTokenizer, generate_corpus  # examples/data, next to this script
from data.shares import Windows
from shardengine.testing.models import build_gpt, lm_loss

import lightning.pytorch as pl  # noqa: E402
from shardengine.integrations.lightning import ShardStrategy, consolidate_checkpoint  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"],
                   help="bf16-mixed: the engine computes in bf16 with fp32 master weights")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--workdir", default="lightning_gpt_run", help="checkpoints and the exported .ckpt go here")
    p.add_argument("--checkpoint-every", type=int, default=20, help="optimizer steps between checkpoints")
    p.add_argument("--resume", choices=["no", "auto"], default="no", help="auto: continue from the newest checkpoint")
    return p.parse_args(argv)


class LitGPT(pl.LightningModule):
    def __init__(self, vocab_size: int, seq_len: int, lr: float, steps: int):
        super().__init__()
        self.save_hyperparameters()
        self.gpt = build_gpt("tiny", vocab_size=vocab_size, seq_len=seq_len)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = lm_loss(self(idx), targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        idx, targets = batch
        self.log("val_loss", lm_loss(self(idx), targets), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup, total = max(1, self.hparams.steps // 10), self.hparams.steps
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.1, 1 - step / total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def newest_checkpoint(folder: str) -> str | None:
    found = sorted(glob.glob(os.path.join(folder, "*.ckpt")), key=os.path.getmtime)
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = generate_corpus(120_000)
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    split = int(len(ids) * 0.9)
    train = DataLoader(Windows(ids[:split], args.seq_len), batch_size=args.micro_batch, shuffle=True)
    val = DataLoader(Windows(ids[split:], args.seq_len), batch_size=args.micro_batch)

    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ckpt_dir = os.path.join(args.workdir, "checkpoints")
    trainer = pl.Trainer(
        accelerator="auto", devices=devices, num_nodes=int(os.environ.get("WORLD_SIZE", devices)) // devices,
        strategy=ShardStrategy(stage=args.stage),           # was: strategy="ddp" / "fsdp" / "deepspeed_stage_3"
        precision=args.precision, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0, val_check_interval=args.checkpoint_every * args.accumulate,
        limit_val_batches=8, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.checkpoint_every,
                                                save_top_k=-1, filename="{step}")])
    model = LitGPT(tokenizer.vocab_size, args.seq_len, args.lr, args.steps)
    resume = newest_checkpoint(ckpt_dir) if args.resume == "auto" else None
    trainer.fit(model, train, val, ckpt_path=resume)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print(f"stage {args.stage}, {trainer.world_size} ranks, {trainer.global_step} steps: {metrics}")
        report = trainer.strategy.sharded_model.memory_report()
        print(f"rank 0 holds {report.model_states / 2**20:.2f} MiB of model states")
        last = newest_checkpoint(ckpt_dir)
        if last is None:  # fewer steps than --checkpoint-every: nothing was saved to export
            print(f"no checkpoint in {ckpt_dir} to export (--steps {args.steps} < --checkpoint-every "
                  f"{args.checkpoint_every})")
            return
        exported = consolidate_checkpoint(last, os.path.join(args.workdir, "model.ckpt"))
        reloaded = LitGPT.load_from_checkpoint(exported)
        idx, targets = next(iter(val))
        with torch.no_grad():
            loss = lm_loss(reloaded(idx), targets).item()
        print(f"exported {last} -> {exported}; reloaded with load_from_checkpoint: val loss {loss:.4f} "
              f"on one batch")


if __name__ == "__main__":
    main()
