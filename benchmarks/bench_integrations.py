#!/usr/bin/env python3
"""Step-time overhead of ShardStrategy (Lightning) and ShardTrainer (Hugging Face) against the
hand-written ``se.shard`` loop, paired in one run.

    python benchmarks/bench_integrations.py                       # launches torchrun, 2 ranks
    python benchmarks/bench_integrations.py --stage 3 --rounds 5 --steps 20

Each round builds, for each of "loop", "lightning" and "hf", a fresh model from the same seed
and the same batches, and times ``--steps`` optimizer steps after ``--warmup`` untimed ones
(round-robin, so machine drift hits all three alike). A step is forward + backward +
``clip_grad_norm_`` + ``optimizer.step()`` + scheduler step + ``zero_grad``, with the trainers'
own per-step work (callbacks, logging bookkeeping, data loading through their loaders)
included; building the trainers is not timed. Step time = wall time of the timed steps / steps
on rank 0 (steps are synchronous across ranks). Reported: median over rounds per variant and
the overhead of each integration = median of the per-round ratios integration / loop - 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardengine as se  # before any process group exists (see the README)
from shardengine.testing.models import build_gpt, lm_loss
from launch import relaunch, under_launcher  # benchmarks/launch.py

VOCAB = 96


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--size", default="1m", help="shardengine.testing.models preset")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per round and variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_integrations.json"))
    return p.parse_args()


def batches_dataset(args: argparse.Namespace, world: int) -> TensorDataset:
    steps = args.warmup + args.steps
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (steps * args.micro_batch * world, args.seq_len + 1), generator=generator)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def rank_loader(data: TensorDataset, args: argparse.Namespace) -> DataLoader:
    return DataLoader(data, batch_size=args.micro_batch,
                      sampler=DistributedSampler(data, num_replicas=se.distributed.world_size(),
                                                 rank=se.distributed.rank(), shuffle=False))


def new_model(args: argparse.Namespace) -> torch.nn.Module:
    return build_gpt(args.size, vocab_size=VOCAB, seq_len=args.seq_len)


def schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.01 * step)


# --------------------------------------------------------------------------- the three variants


def time_loop(args: argparse.Namespace, data: TensorDataset) -> float:
    net = new_model(args)
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=args.stage)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    start = None
    for index, (idx, targets) in enumerate(rank_loader(data, args)):
        if index == args.warmup:
            start = time.perf_counter()
        lm_loss(model(idx), targets).backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / args.steps


class StepTimer:
    """Wall time from the start of step ``warmup`` to the end of the last step."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.end, self.count = warmup, None, None, 0

    def begin(self) -> None:
        if self.count == self.warmup:
            self.start = time.perf_counter()

    def finish(self) -> None:
        self.count += 1
        self.end = time.perf_counter()

    def per_step(self, steps: int) -> float:
        return (self.end - self.start) / steps


def time_lightning(args: argparse.Namespace, data: TensorDataset) -> float:
    import lightning.pytorch as pl
    from shardengine.integrations.lightning import ShardStrategy

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = new_model(args)

        def training_step(self, batch, batch_idx):
            return lm_loss(self.gpt(batch[0]), batch[1])

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    timer = StepTimer(args.warmup)

    class Timing(pl.Callback):
        def on_train_batch_start(self, *_):
            timer.begin()

        def on_train_batch_end(self, *_):
            timer.finish()

    trainer = pl.Trainer(accelerator="cpu", devices=se.distributed.world_size(),
                         strategy=ShardStrategy(stage=args.stage), max_steps=args.warmup + args.steps,
                         gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[Timing()])
    trainer.fit(Lit(), rank_loader(data, args))
    return timer.per_step(args.steps)


def time_hf(args: argparse.Namespace, data: TensorDataset) -> float:
    import transformers
    from shardengine.integrations.transformers import ShardTrainer

    class LM(torch.nn.Module):  # Trainer wants (loss, ...) from forward(**batch)
        def __init__(self):
            super().__init__()
            self.gpt = new_model(args)

        def forward(self, input_ids, labels):
            return {"loss": lm_loss(self.gpt(input_ids), labels)}

    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i][0], "labels": data[i][1]}

    timer = StepTimer(args.warmup)

    class Timing(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            timer.begin()

        def on_step_end(self, *_, **__):
            timer.finish()

    training_args = transformers.TrainingArguments(
        output_dir=os.path.join("/tmp", f"bench_integrations_{os.getpid()}"), per_device_train_batch_size=args.micro_batch,
        learning_rate=1e-3, weight_decay=0.0, lr_scheduler_type="constant", max_steps=args.warmup + args.steps,
        max_grad_norm=1.0, logging_steps=10_000, save_strategy="no", report_to="none",
        train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True)
    trainer = ShardTrainer(model=LM(), args=training_args, train_dataset=Dicts(), callbacks=[Timing()],
                           shard_config={"stage": args.stage})
    trainer.train()
    return timer.per_step(args.steps)


# --------------------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> None:
    se.init_distributed()
    torch.set_num_threads(1)
    import transformers
    transformers.logging.set_verbosity_error()
    data = batches_dataset(args, se.distributed.world_size())
    variants = {"loop": time_loop, "lightning": time_lightning, "hf": time_hf}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            torch.manual_seed(0)
            times[name].append(fn(args, data))
    if se.distributed.is_main_process():
        report(args, times)


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    loop = times["loop"]
    rows = []
    print(f"\nstage {args.stage}, {args.size} GPT, micro-batch {args.micro_batch} x {args.seq_len}, "
          f"{se.distributed.world_size()} ranks, {args.rounds} rounds x {args.steps} steps")
    print("| variant | median step (ms) | overhead vs loop (median of paired ratios) | per-round ratios |")
    print("|---|---|---|---|")
    for name, values in times.items():
        ratios = [v / base for v, base in zip(values, loop)]
        overhead = statistics.median(ratios) - 1
        rows.append({"variant": name, "median_step_s": statistics.median(values), "overhead": overhead,
                     "ratios": ratios, "step_s": values})
        print(f"| {name} | {1e3 * statistics.median(values):.1f} | {100 * overhead:+.1f}% | "
              f"{', '.join(f'{r:.3f}' for r in ratios)} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def main() -> None:
    args = parse_args()
    if not under_launcher():
        sys.exit(relaunch(__file__, args.nproc))
    run(args)


if __name__ == "__main__":
    main()
