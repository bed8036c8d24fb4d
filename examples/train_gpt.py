#!/usr/bin/env python3
"""Train a small GPT on a generated character corpus with shardengine.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/train_gpt.py --stage 2

CPU + Gloo by default; CUDA + NCCL (cuda:LOCAL_RANK) when GPUs are present,
both chosen by ``se.init_distributed()``. Without torchrun it runs on one rank.
Rank 0 prints the memory estimator's verdict, the loss, speed, per-rank memory
by category and bytes communicated per step, then a summary.

Uneven data (ranks of different speeds)::

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --proportions 0.7,0.3
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --proportions auto --slow-rank 1 --slow-factor 2

``--proportions`` splits each global micro-batch (``--micro-batch`` x ranks) by
the shares; ``auto`` measures each rank's work over the first steps and
re-balances. ``--slow-rank r --slow-factor f`` makes rank r's forward and
backward take f times as long (it sleeps the difference after the forward), to
try it on one machine.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

import shardengine as se
from shardengine.distributed.launch import all_gather_object_default_group
from data.corpus import get_batch, load_corpus  # examples/data, next to this script
from data.shares import UnevenData, parse_proportions, slashed
from memory_check import check_lines, estimate_line, log_memory, table_categories  # examples/, next to this script
from memory_estimator import estimate
from memory_estimator.cli.command import format_table
from memory_estimator.model.module import LiveBytesTracker
from memory_estimator.cli.timing_flags import parse_compression_flag
from shardengine.testing.models import GPTConfig, build_gpt, example_inputs, lm_loss

MB = 2**20
console = Console(soft_wrap=True)  # long log lines stay on one line in log files


def _stage(text: str):
    if text == "auto":
        return text
    if text in ("0", "1", "2", "3"):
        return int(text)
    raise argparse.ArgumentTypeError(f"stage must be 0, 1, 2, 3 or auto, got {text!r}")


def _group_size(text: str) -> int | str:
    if text == "node" or text.isdigit():
        return text if text == "node" else int(text)
    raise argparse.ArgumentTypeError(f"shard group size must be a number of ranks or 'node', got {text!r}")


def _proportions(text: str) -> list[float] | str:
    try:
        return parse_proportions(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=_stage, default=2,
                   help="ZeRO stage 0-3, or 'auto' to take the estimator's recommendation")
    p.add_argument("--shard-group-size", type=_group_size, default=None,
                   help="hybrid sharding (stages 1-3): shard within groups of this many ranks and replicate "
                        "across them; 'node': the ranks of one node (default: all ranks)")
    p.add_argument("--compression", type=parse_compression_flag, default=None, metavar="SPEC",
                   help="compressed communication: bf16, fp16, int8 or powersgd (gradients), or key=value "
                        "pairs, e.g. grads=int8,params=int8 (see docs/compression.md)")
    p.add_argument("--preset", default="1m", choices=GPTConfig.preset_names(), help="model size")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per micro-step")
    p.add_argument("--seq-len", type=int, default=128, help="context length (model block size)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16/fp16: compute in that dtype with fp32 master weights and optimizer state "
                        "(fp16 with dynamic loss scaling)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate")
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm; 0 disables clipping")
    p.add_argument("--seed", type=int, default=0, help="model init seed; data uses seed + rank")
    p.add_argument("--log-every", type=int, default=20, help="steps between log lines")
    p.add_argument("--eval-batches", type=int, default=8, help="validation micro-batches at the end")
    p.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here (step_<k>/, latest)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints; 0: none")
    p.add_argument("--resume", choices=["auto", "never"], default="auto",
                   help="auto: continue from --checkpoint-dir's latest checkpoint if there is one")
    p.add_argument("--export", default=None,
                   help="at the end, rank 0 writes the trained weights here: a plain state_dict "
                        "(torch.save) that loads into the unwrapped model")
    p.add_argument("--proportions", type=_proportions, default=None,
                   help="uneven data: each rank's share of the global micro-batch (--micro-batch x ranks), "
                        "e.g. 0.7,0.3; 'auto': measure each rank's speed and re-balance (default: equal "
                        "shares of randomly drawn batches)")
    p.add_argument("--auto-window", type=int, default=4, help="--proportions auto: steps timed per measurement")
    p.add_argument("--auto-rounds", type=int, default=2, help="--proportions auto: measurements (re-balancings)")
    p.add_argument("--slow-rank", type=int, default=None,
                   help="demo of a slower rank: this rank sleeps after each forward ...")
    p.add_argument("--slow-factor", type=float, default=2.0,
                   help="... so that its forward+backward take this many times as long (default 2)")
    args = p.parse_args(argv)
    if args.slow_factor < 1 or args.auto_window < 1 or args.auto_rounds < 0:
        p.error("--slow-factor must be >= 1, --auto-window >= 1 and --auto-rounds >= 0")
    return args


def run_estimate(args: argparse.Namespace, vocab_size: int, world_size: int, micro_batch: int,
                 proportions: list[float] | None = None):
    """The memory estimator's answer for this run (traced on fake tensors, nothing allocated)."""
    return estimate(module=functools.partial(build_gpt, args.preset, vocab_size=vocab_size, seq_len=args.seq_len),
                    example_inputs=functools.partial(example_inputs, vocab_size=vocab_size),
                    world_size=world_size, precision=args.precision, optimizer="adamw",
                    micro_batch=micro_batch, seq_len=args.seq_len, device="this-machine", proportions=proportions)


def print_estimate(args: argparse.Namespace, vocab_size: int, world_size: int):
    """Rank 0: what the memory estimator predicts for exactly this run; returns its answer."""
    verdict = run_estimate(args, vocab_size, world_size, args.micro_batch,
                           args.proportions if isinstance(args.proportions, list) else None)
    console.print(format_table(verdict), highlight=False)
    console.print(f"estimator: recommended plan {verdict.recommended}"
                  + ("; stage='auto' plans the fastest run that fits (printed below)" if args.stage == "auto" else ""))
    return verdict


def plan_of_this_run(args: argparse.Namespace, verdict, vocab_size: int, model, micro_batch: int):
    """Rank 0: the estimate of the plan this run uses, for this rank as it runs: re-estimated
    for its micro-batch (uneven data) and for the shard group (hybrid sharding: N -> K)."""
    if model.shard_group_size != se.distributed.world_size() or micro_batch != args.micro_batch or \
            isinstance(args.proportions, list):
        verdict = run_estimate(args, vocab_size, model.shard_group_size, micro_batch)
    plan = next(plan for plan in verdict.plans if plan.stage == model.stage and not plan.offload)
    console.print(estimate_line(plan), highlight=False)
    return plan


def make_model_and_optimizer(args: argparse.Namespace, vocab_size: int, device: torch.device):
    """Same seed on every rank, so all ranks start from identical weights."""
    model = build_gpt(args.preset, vocab_size=vocab_size, seq_len=args.seq_len, seed=args.seed).to(device)
    adamw = functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model, optimizer = se.shard(model, adamw, stage=args.stage, micro_batch=args.micro_batch,
                                seq_len=args.seq_len, shard_group_size=args.shard_group_size,
                                compression=args.compression,
                                param_dtype=None if args.precision == "fp32" else args.precision,
                                example_inputs=functools.partial(example_inputs, vocab_size=vocab_size))
    args.stage = model.stage  # "auto" resolved
    if model.auto_plan is not None and model.auto_plan.grad_accum > 1:  # auto split the batch: run its micro-steps
        args.micro_batch = model.auto_plan.micro_batch
        args.grad_accum *= model.auto_plan.grad_accum
    # The sharded optimizer is a plain torch.optim instance, so schedulers work as usual.
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, args.warmup)))
    return model, optimizer, warmup


def train_step(model, optimizer, batches, clip: float, slow_factor: float = 1.0,
               after_step=None) -> tuple[torch.Tensor, float, float]:
    """One optimizer step over the micro-batches; gradients sync only on the last one.

    Ranks' micro-batches may differ in size: the engine weights each rank's gradient by
    its batch size, so with the mean loss the step is the mean over all ranks' samples.
    Also returns this rank's work: seconds of forward and backward, less the time spent
    in collectives (waiting for the others). The demo's slow rank (``slow_factor`` f)
    sleeps (f - 1) x its forward+backward time between the two, taking backward as twice
    forward (its FLOPs), so the delay comes before the backward's collectives as a slower
    device's would, not after them.
    """
    total = torch.zeros((), device=batches[0][0].device)
    work = 0.0
    for i, (idx, targets) in enumerate(batches):
        last = i == len(batches) - 1
        started, waited = time.perf_counter(), model.comm_stats().seconds
        with contextlib.nullcontext() if last else model.no_sync():
            loss = lm_loss(model(idx), targets) / len(batches)
            if slow_factor > 1:
                time.sleep((slow_factor - 1) * 3 * (time.perf_counter() - started))
            loss.backward()
        work += time.perf_counter() - started - (model.comm_stats().seconds - waited)
        total += loss.detach()
    norm = model.clip_grad_norm_(clip if clip > 0 else math.inf)  # global norm, over all shards
    optimizer.step()
    if after_step is not None:
        after_step()  # gradients are still held here; zero_grad() frees them
    optimizer.zero_grad()
    return total, float(norm), work


def mean_over_ranks(value: torch.Tensor) -> float:
    """Average a scalar over ranks (for logging only; not counted in comm_stats)."""
    value = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


@torch.no_grad()
def evaluate(model, data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    """Mean validation loss; every rank runs it (stage 3 gathers parameters in forward)."""
    gen = torch.Generator().manual_seed(10_000 + se.distributed.rank())
    losses = [lm_loss(model(x.to(device)), y.to(device))
              for x, y in (get_batch(data, args.micro_batch, args.seq_len, gen) for _ in range(args.eval_batches))]
    return mean_over_ranks(torch.stack(losses).mean())


def log_line(step: int, loss: float, norm: float, window: "Window", tokens_per_step: int, model) -> str:
    """One log line: averages over the steps since the previous line; memory of this rank."""
    mem, stats = model.memory_report(), model.step_stats()  # step_stats: since the last line
    step_s = window.seconds / window.steps
    return (f"step {step:5d} | loss {loss:.4f} | gnorm {norm:.3f} | {step_s * 1e3:7.1f} ms/step"
            f" | {tokens_per_step / step_s:9.0f} tok/s | comm {stats.bytes_total / window.steps / MB:7.2f} MiB/step"
            f" ({100 * stats.comm_seconds / window.seconds:4.1f}% time) | "
            + log_memory(mem, stats.peak_tracked_bytes, stats.peak_device_bytes)
            + (f" | loss scale {stats.loss_scale:g}, {stats.skipped_steps} step(s) skipped"
               if stats.loss_scale is not None else ""))


def measured_step(model, optimizer, batches, args, slow_factor: float, plan, step: int):
    """A step with its memory measured (every rank, so their timings stay alike); rank 0
    prints it next to the estimate ``plan``."""
    cuda = batches[0][0].device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tracker = LiveBytesTracker()  # counts tensors created while it is active, dropped or not
    reports = []  # model states as the step left them, before zero_grad() frees the gradients
    with tracker:
        result = train_step(model, optimizer, batches, args.clip, slow_factor,
                            after_step=lambda: reports.append(model.memory_report()))
    if plan is not None:
        device_peak = torch.cuda.max_memory_allocated() if cuda else None
        console.print("\n".join(check_lines(plan, reports[0], tracker.peak_bytes, se.distributed.rank(), step,
                                             device_peak)), highlight=False)
    return result


def memory_table(model) -> Table:
    """Per-rank memory by category, one column per rank (collective: every rank calls it); only
    the categories that apply to this run (see ``memory_check.table_categories``)."""
    report = model.memory_report().as_dict()
    del report["peak_comm_buffers"]  # since the last log line only: the log lines show peaks
    reports = [report] * se.distributed.world_size()
    if se.distributed.world_size() > 1:
        dist.all_gather_object(reports, report)
    table = Table(title="memory per rank (MiB)")
    table.add_column("category")
    for r in range(len(reports)):
        table.add_column(f"rank {r}", justify="right")
    for key in table_categories(reports):
        table.add_row(key, *(f"{rep[key] / MB:.2f}" for rep in reports))
    return table


def print_summary(args, history, step_times, tokens_per_step, val_loss, stats, num_params,
                  ring_bytes: int, resumed_at: int = 0) -> None:
    """Rank 0, after training: loss, speed and traffic (``stats``: comm_stats taken after training;
    ``ring_bytes``: the engine's ring-model bytes per step)."""
    steps = len(step_times)
    n = se.distributed.world_size()
    console.rule("summary")
    console.print(f"stage {args.stage}, {n} rank(s), preset {args.preset} ({num_params:,} params), {steps} steps"
                  + (f" (steps {resumed_at + 1}-{args.steps}, resumed at step {resumed_at})"
                     if resumed_at and steps else ""))
    if not steps:  # a restart after the last checkpoint: the trained model, evaluated again
        console.print(f"training already complete: resumed at step {resumed_at} = --steps {args.steps}, "
                      f"no step to train; validation loss {val_loss:.4f}")
        return
    timed = step_times[1:] or step_times  # first step includes warm-up
    step_s = sum(timed) / len(timed)
    console.print(f"train loss {history[0][1]:.4f} (step {history[0][0]}) -> {history[-1][1]:.4f} "
                  f"(step {history[-1][0]}); validation loss {val_loss:.4f}")
    console.print(f"{step_s * 1e3:.1f} ms/step, {tokens_per_step / step_s:,.0f} tokens/s (all ranks)")
    console.print(f"communicated {stats.bytes_total / steps / MB:.2f} MiB/step per rank "
                  f"(ring-model expectation {ring_bytes / MB:.2f} MiB + the clipping norm's scalar), "
                  f"{stats.calls / steps:.1f} calls/step, "
                  f"{stats.seconds / steps * 1e3:.1f} ms/step in collectives")
    for kind, nbytes in sorted(stats.bytes_by_kind.items()):
        console.print(f"  {kind:>24}: {nbytes / steps / MB:8.2f} MiB/step")
    if stats.by_group["inter_group"].bytes_total:  # hybrid sharding: what crossed between the groups
        console.print("by group: " + ", ".join(f"{name} {group.bytes_total / steps / MB:.2f} MiB/step"
                                               for name, group in stats.by_group.items()))


def shares_line(window: "Window", data: UnevenData | None) -> str:
    """Each rank's share of the global batch, its work and its step time (collective)."""
    mine = (data.batches.proportions[se.distributed.rank()] if data else 1 / se.distributed.world_size(),
            data.batches.batch_size if data else None, window.work / window.steps, window.seconds / window.steps)
    ranks = all_gather_object_default_group(mine)
    shares, batches, work, step = zip(*ranks)
    return (f"  shares {slashed(shares, '.3f')} | micro-batch {slashed(batches, '')} | work ms/step "
            f"{slashed([w * 1e3 for w in work], '.1f')} | step ms {slashed([s * 1e3 for s in step], '.1f')}")


def print_shares(data: UnevenData, step_times: list[float], resumed_at: int) -> None:
    """Rank 0: the final shares and the step time since they were set."""
    since = max(data.balanced_from, resumed_at + 1) + 1  # its first step warms up (new batch sizes)
    timed = step_times[since - resumed_at - 1:]
    if timed:
        console.print(f"shares {slashed(data.batches.proportions, '.3f')} (micro-batches "
                      f"{slashed(data.batches.sizes, 'd')}) from step {since}: "
                      f"{sum(timed) / len(timed) * 1e3:.1f} ms/step over {len(timed)} steps")


def tokens_per_step(args: argparse.Namespace) -> int:
    """Tokens consumed by one optimizer step, all ranks together."""
    return args.micro_batch * args.seq_len * args.grad_accum * se.distributed.world_size()


@dataclasses.dataclass
class Window:
    """Steps and seconds since the last log line."""

    seconds: float = 0.0
    steps: int = 0
    work: float = 0.0  # this rank's forward + backward, less waits in collectives


def resume(args, model, optimizer, scheduler, data: UnevenData | None = None) -> int:
    """The last completed step of the checkpoint we continue from (0: a fresh start)."""
    latest = os.path.join(args.checkpoint_dir or "", "latest")
    if not args.checkpoint_dir or args.resume == "never" or not os.path.exists(latest):
        return 0
    started = time.perf_counter()
    extra = se.load_checkpoint(args.checkpoint_dir, model, optimizer)  # also the RNGs; any world size/stage
    scheduler.load_state_dict(extra["scheduler"])
    if data is not None and extra.get("data"):  # where the batches and shares were
        data.load_state_dict(extra["data"])
    if se.distributed.is_main_process():
        console.print(f"resumed from {args.checkpoint_dir} at step {extra['step']} "
                      f"(loaded in {time.perf_counter() - started:.2f} s)")
    return extra["step"]


def maybe_save(args, step: int, model, optimizer, scheduler, data: UnevenData | None = None) -> None:
    """Every ``--checkpoint-every`` steps and at the end; collective (every rank writes its shard)."""
    if not (args.checkpoint_dir and args.checkpoint_every):
        return
    if step % args.checkpoint_every == 0 or step == args.steps:
        started = time.perf_counter()
        path = se.save_checkpoint(args.checkpoint_dir, model, optimizer,
                                  extra={"step": step, "scheduler": scheduler.state_dict(),
                                         "data": data.state_dict() if data else None})
        if se.distributed.is_main_process():
            size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            console.print(f"checkpoint {path}: {size / MB:.2f} MiB, saved in {time.perf_counter() - started:.2f} s")


def batch_source(args, train_data: torch.Tensor, info, resumed_at: int, data: UnevenData | None):
    """A function returning this rank's next (inputs, targets) micro-batch."""
    if data is not None:  # --proportions: the sampler's windows (a resumed position came with the checkpoint)
        return data.next
    gen = torch.Generator().manual_seed(args.seed + info.rank)  # each rank draws different data
    for _ in range(resumed_at * args.grad_accum):  # replay the data order up to the resumed step
        get_batch(train_data, args.micro_batch, args.seq_len, gen)
    return lambda: get_batch(train_data, args.micro_batch, args.seq_len, gen)


def train(args, model, optimizer, scheduler, train_data: torch.Tensor, info,
          resumed_at: int = 0, data: UnevenData | None = None, plan=None) -> tuple[list, list]:
    """The training loop from step ``resumed_at + 1``; its second step's memory is measured
    (rank 0 prints it next to the estimate ``plan``).

    Returns ([(step, mean loss)] at log steps, [seconds per step]).
    """
    next_batch = batch_source(args, train_data, info, resumed_at, data)
    slow_factor = args.slow_factor if args.slow_rank == info.rank else 1.0
    history, step_times, window = [], [], Window()
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[loss]}"), console=console,
                        disable=not se.distributed.is_main_process())
    with progress:
        task = progress.add_task("train", total=args.steps, loss="", completed=resumed_at)
        for step in range(resumed_at + 1, args.steps + 1):
            batches = [tuple(t.to(info.device) for t in next_batch()) for _ in range(args.grad_accum)]
            start = time.perf_counter()
            if step == min(resumed_at + 2, args.steps):  # the first step creates the optimizer state
                loss, norm, work = measured_step(model, optimizer, batches, args, slow_factor, plan, step)
            else:
                loss, norm, work = train_step(model, optimizer, batches, args.clip, slow_factor)
            scheduler.step()
            step_times.append(time.perf_counter() - start)
            window.seconds, window.steps, window.work = window.seconds + step_times[-1], window.steps + 1, \
                window.work + work
            if step % args.log_every == 0 or step in (resumed_at + 1, args.steps):
                history.append((step, mean_over_ranks(loss)))
                lines = [log_line(step, history[-1][1], norm, window, tokens_per_step(args), model)]
                if data is not None or args.slow_rank is not None:
                    lines.append(shares_line(window, data))
                window = Window()
                if se.distributed.is_main_process():
                    progress.console.print("\n".join(lines))
            rebalanced = data.after_step(step, work) if data is not None else None
            if rebalanced and se.distributed.is_main_process():
                progress.console.print(rebalanced)
            progress.update(task, advance=1, loss=f"loss {history[-1][1]:.3f}")
            maybe_save(args, step, model, optimizer, scheduler, data)
    return history, step_times


def refuse_steps_below(args, resumed_at: int) -> None:
    """--steps below the checkpoint's step: nothing this command can mean (exit code 2)."""
    if se.distributed.is_main_process():
        print(f"train_gpt.py: error: --steps {args.steps} is below step {resumed_at} of the checkpoint resumed "
              f"from {args.checkpoint_dir}; pass --steps {resumed_at} or more to continue it, or --resume never "
              f"(or another --checkpoint-dir) to train from scratch", file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = se.init_distributed()
    tok, train_data, val_data = load_corpus()
    if args.slow_rank is not None and not 0 <= args.slow_rank < info.world_size:
        raise se.ConfigError(f"--slow-rank {args.slow_rank} is not a rank of this {info.world_size}-rank run")
    data = None
    if args.proportions is not None:
        data = UnevenData(train_data, args.seq_len, args.micro_batch * info.world_size, args.proportions,
                          args.seed, args.auto_window, args.auto_rounds)
    verdict = None
    if se.distributed.is_main_process():
        console.rule(f"shardengine example: stage {args.stage}, {info.world_size} rank(s) on {info.device}")
        verdict = print_estimate(args, tok.vocab_size, info.world_size)
    model, optimizer, scheduler = make_model_and_optimizer(args, tok.vocab_size, info.device)
    plan = None
    if verdict is not None:
        plan = plan_of_this_run(args, verdict, tok.vocab_size, model,
                                data.batches.batch_size if data is not None else args.micro_batch)
    resumed_at = resume(args, model, optimizer, scheduler, data)
    if resumed_at > args.steps:
        refuse_steps_below(args, resumed_at)
    if resumed_at == args.steps and se.distributed.is_main_process():
        console.print(f"training already complete: the checkpoint is at step {resumed_at} = --steps; "
                      "evaluating it (a restart after the last step exits 0)")
    model.reset_comm_stats()  # count training traffic only, not the initial broadcast (or the load)
    history, step_times = ([], []) if resumed_at == args.steps else \
        train(args, model, optimizer, scheduler, train_data, info, resumed_at, data, plan)
    comm = model.comm_stats()  # training traffic only: taken before the evaluation's forwards
    val_loss = evaluate(model, val_data, args, info.device)
    table = memory_table(model)
    weights = model.full_state_dict(rank0_only=True) if args.export else {}  # collective
    if weights and se.distributed.is_main_process():
        torch.save(weights, args.export)
        console.print(f"exported the trained weights to {args.export}")
    if se.distributed.is_main_process():
        num_params = GPTConfig.preset(args.preset, vocab_size=tok.vocab_size, seq_len=args.seq_len).num_params()
        print_summary(args, history, step_times, tokens_per_step(args), val_loss, comm, num_params,
                      model.ring_model_bytes(args.grad_accum), resumed_at)
        if data is not None:
            print_shares(data, step_times, resumed_at)
        console.print(table)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
