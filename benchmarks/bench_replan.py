#!/usr/bin/env python3
"""What a change of the trainable set after ``shard()`` costs (docs/compile-and-trainable-set.md).

    python benchmarks/bench_replan.py --preset 10m           # launches torchrun itself (N=2)

The example GPT (``build_gpt``) is sharded with its upper half of blocks (at least two) frozen
(gradual unfreezing), trained one step, then one frozen block is unfrozen. The
next training forward re-plans (stages/replan.py); this prints, per stage, the
re-plan's time (``model.engine.replans``), the bytes it added (gradient
buffers and fp32 masters) and what ``memory_report()`` shows after the next
step against before, and the step times just before and after. The same for
``optimizer.add_param_group`` of a second unfrozen block with its own lr.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardengine as se
from shardengine.testing.models import build_gpt, example_inputs, lm_loss
from launch import relaunch  # benchmarks/launch.py


def timed_step(model, optimizer, batch) -> float:
    dist.barrier()
    start = time.perf_counter()
    lm_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return time.perf_counter() - start


def run_stage(stage: int, args) -> dict:
    model = build_gpt(args.preset, seq_len=args.seq_len, seed=0)
    frozen = list(model.blocks)[-max(2, len(model.blocks) // 2):]
    for block in frozen:
        block.requires_grad_(False)
    # frozen[0] is in the optimizer from the start (gradual unfreezing); frozen[1] joins later.
    in_groups = [p for p in model.parameters() if p.requires_grad] + list(frozen[0].parameters())
    wrapped, optimizer = se.shard(model, torch.optim.AdamW(in_groups, lr=1e-3), stage=stage,
                                  param_dtype="bf16" if args.bf16 else None)
    batch = example_inputs(args.micro_batch, args.seq_len, seed=dist.get_rank())
    before = [timed_step(wrapped, optimizer, batch) for _ in range(3)][-1]
    memory_before = wrapped.memory_report()
    frozen[0].requires_grad_(True)                    # gradual unfreezing: in its group at wrap
    unfreeze_step = timed_step(wrapped, optimizer, batch)
    frozen[1].requires_grad_(True)                    # a new group with its own lr
    optimizer.add_param_group({"params": list(frozen[1].parameters()), "lr": 1e-4})
    group_step = timed_step(wrapped, optimizer, batch)
    after = timed_step(wrapped, optimizer, batch)
    memory_after = wrapped.memory_report()
    unfreeze, group = wrapped.engine.replans[-2:]
    return {"stage": stage, "step_s": before, "after_s": after, "unfreeze_step_s": unfreeze_step,
            "group_step_s": group_step, "unfreeze": unfreeze, "group": group,
            "grads_added": memory_after.grads - memory_before.grads,
            "states_added": memory_after.optimizer_states - memory_before.optimizer_states}


def launch_self(args) -> int:
    return relaunch(str(Path(__file__).resolve()), args.nproc, echo=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="10m")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="param_dtype='bf16' (fp32 masters)")
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        return launch_self(args)
    se.init_distributed()
    torch.set_num_threads(1)
    rows = [run_stage(int(s), args) for s in args.stages.split(",")]
    if dist.get_rank() == 0:
        print(f"{args.preset} GPT, N={dist.get_world_size()}, {'bf16' if args.bf16 else 'fp32'}; "
              "one of the frozen blocks unfrozen, then another added as a new param group")
        print("stage | step s | re-plan ms (unfreeze / add group) | bytes added at re-plan | "
              "grads + optimizer states after vs before (bytes) | first step after (s)")
        for r in rows:
            print(f"{r['stage']} | {r['step_s']:.3f} | {r['unfreeze'].seconds * 1e3:.2f} / {r['group'].seconds * 1e3:.2f} | "
                  f"{r['unfreeze'].bytes_added:,} / {r['group'].bytes_added:,} | "
                  f"+{r['grads_added']:,} + {r['states_added']:,} | "
                  f"{r['unfreeze_step_s']:.3f} / {r['group_step_s']:.3f} (then {r['after_s']:.3f})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
