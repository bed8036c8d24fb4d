#!/usr/bin/env python3
"""The planner's long-context plans run: measured peak against the plan, chosen step time against the next two.

    python benchmarks/bench_activation_plan.py                       # 12-layer GPT, seq 1k/2k/4k, ~10 min here
    python benchmarks/bench_activation_plan.py --seq-lens 4096,8192,16384 --rounds 5   # the issue's lengths
    python benchmarks/bench_activation_plan.py --layers 2 --seq-lens 128 --rounds 2 --calibration none  # smoke

Launches ``--nproc`` CPU ranks (Gloo) itself. Per sequence length, rank 0 asks the planner what
``stage="auto"`` asks (``memory_estimator.auto_plan``: the same request, with a device budget of
``--budget-fraction`` of the least total any plan needs without a lever, so model states and
activations alone do not fit) and takes its three best-ranked runs. Every rank builds the same
GPT (``shardengine.testing.models``, ``--layers`` x width ``--width``, fp32 AdamW) once per run
with that run's ``shard()`` options and trains it round-robin, ``--rounds`` rounds of one
optimizer step each (the run's micro-batch x accumulation, ``no_sync()`` on all but the last
micro-step), after a warm-up step. Per run:

* **planned**: the plan's device bytes per rank; **held**: the model states before the step (host tiers too: on CPU the device is host RAM) plus
  the most the step allocated (``AllocatorTracker``, first step), against **promised**: the plan's
  device bytes per rank plus its host bytes per rank. PASS when held <= promised;
* **step**: the median step time over the rounds (the slowest rank's, between barriers) and the
  noise (half the inter-quartile range over the median); the chosen run PASSes when its median is
  no more than the noise above either of the next two.

The time model prices the runs with ``--calibration`` (a file ``memory-estimator calibrate``
writes; made first when missing; ``none``: rank by the levers' cost). Runs that need the engine's
activation levers (``shard(activation_checkpointing=...)``) are listed, not run, on an engine
without them. Writes ``--json``; the table of a run here is in docs/memory.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import relaunch, under_launcher  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="1024,2048,4096")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--budget-fraction", type=float, default=0.75,
                        help="device budget: this fraction of the least total without a lever (default 0.75)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calibration", default=str(RESULTS / "calibration.json"),
                        help="this machine's calibration (made when missing), or 'none'")
    parser.add_argument("--json", default=str(RESULTS / "bench_activation_plan.json"))
    return parser.parse_args(argv)


def build(args, seq_len: int):
    from shardengine.testing.models import build_gpt

    torch.manual_seed(0)
    return build_gpt("tiny", n_layer=args.layers, n_embd=args.width, n_head=args.heads, seq_len=seq_len,
                     vocab_size=args.vocab)


def batch(args, micro_batch: int, seq_len: int, seed: int = 0):
    from shardengine.testing.models import example_inputs

    return example_inputs(micro_batch, seq_len, vocab_size=args.vocab, seed=seed)


def plan(args, seq_len: int, world: int) -> dict:
    """Rank 0: the budget and the planner's answer for this length (what stage="auto" asks)."""
    import memory_estimator as me
    import psutil

    model = build(args, seq_len)

    def request(budget: int):
        return me.EstimateRequest(
            me.ModelRequest(module=model, example_inputs=lambda b, s: batch(args, b, s)),
            me.TrainingRequest(world_size=world, precision="fp32", optimizer=torch.optim.AdamW(model.parameters()),
                               micro_batch=args.micro_batch, seq_len=seq_len),
            engine=me.EngineRequest(options=me.EngineOptions(reduces_in_place=True)),
            target=me.TargetRequest(device="cpu", device_memory_bytes=budget, ranks_per_node=world,
                                    host_memory_bytes=psutil.virtual_memory().available))

    no_lever = min(p.total for p in me.estimate(request(2**40)).plans)
    budget = int(args.budget_fraction * no_lever)
    answer = me.auto_plan(request(budget), local_world_size=world, activation_levers=_engine_levers())
    return {"seq_len": seq_len, "no_lever_bytes": no_lever, "budget": budget, **answer}


def _engine_levers() -> bool:
    from shardengine.config import known_options

    return "activation_checkpointing" in known_options()


def shard_kwargs(run: dict) -> dict:
    options = {"offload_optimizer": run["offload_optimizer"], "offload_params": run["offload_params"],
               "offload_device_budget": run["device_budget"]}
    if run["stage"] == 3:
        options["reshard_after_forward"] = run["reshard_after_forward"]
    if run["checkpointing"] != "none":
        options["activation_checkpointing"] = run["checkpointing"]
    if run["activation_offload"]:
        options["activation_offload"] = True
    return options


def train_step(model, optimizer, args, run: dict, seq_len: int, seed: int) -> None:
    micro = run["micro_batch"]
    for index in range(run["grad_accum"]):
        idx, targets = batch(args, micro, seq_len, seed=seed * 1000 + index)
        last = index == run["grad_accum"] - 1
        with contextlib.nullcontext() if last else model.no_sync():
            model(idx, targets).backward()
    optimizer.step()
    optimizer.zero_grad()


def measure(args, answer: dict) -> list[dict]:
    """Every rank: the three ranked runs, built side by side and stepped round-robin."""
    import shardengine as se
    from shardengine.testing.allocator_tracker import AllocatorTracker

    seq_len, rows, live = answer["seq_len"], [], []
    for run in answer.get("ranked", []):
        row = {"run": run}
        needs = run["checkpointing"] != "none" or run["activation_offload"]
        if needs and not _engine_levers():
            rows.append({**row, "skipped": "needs the engine's activation levers"})
            continue
        net = build(args, seq_len)
        model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters()), stage=run["stage"], **shard_kwargs(run))
        held = model.memory_report()
        with AllocatorTracker() as tracker:
            with tracker.phase("step"):
                train_step(model, optimizer, args, run, seq_len, seed=0)
        row.update(held=held.model_states + held.host_model_states + tracker.peak_in("step"),
                   promised=answer["budget"] + run["host_bytes"], times=[])
        rows.append(row)
        live.append((row, model, optimizer))
    for round_index in range(args.rounds):
        for row, model, optimizer in live:
            dist.barrier()
            started = time.perf_counter()
            train_step(model, optimizer, args, row["run"], seq_len, seed=round_index + 1)
            dist.barrier()
            row["times"].append(time.perf_counter() - started)
    return rows


def summary(rows: list[dict]) -> None:
    """Median step, noise and the verdicts, in place on each row."""
    timed = [row for row in rows if row.get("times")]
    for row in timed:
        times = sorted(row["times"])
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        row["median_s"] = statistics.median(times)
        row["noise"] = (quartiles[2] - quartiles[0]) / 2 / row["median_s"]
        row["within_plan"] = row["held"] <= row["promised"]
    if timed and rows[0] is timed[0] and len(timed) > 1:
        chosen, noise = timed[0], max(row["noise"] for row in timed)
        chosen["not_slower"] = all(chosen["median_s"] <= other["median_s"] * (1 + noise) for other in timed[1:])


def table(results: list[dict]) -> str:
    lines = ["| seq | budget MiB | rank | plan | checkpointing | act. offload | micro x accum | planned MiB "
             "| promised MiB | held MiB | predicted s | measured s (noise) | verdict |", "|" + "---|" * 13]
    for result in results:
        for rank, row in enumerate(result["rows"], 1):
            run = row["run"]
            predicted = f"{run['step_time_s']:.3g}" if run.get("step_time_s") else "-"
            if "skipped" in row:
                measured, held, verdict = row["skipped"], "-", "-"
            else:
                measured = f"{row['median_s']:.3g} (±{row['noise']:.0%})"
                held = f"{row['held'] / 2**20:.1f}"
                verdict = ("PASS" if row["within_plan"] else "MISS") + (
                    "" if "not_slower" not in row else (", fastest PASS" if row["not_slower"] else ", fastest MISS"))
            name = run["plan"] + (" (no reshard)" if run["stage"] == 3 and not run["reshard_after_forward"] else "")
            lines.append(f"| {result['seq_len']} | {result['budget'] / 2**20:.1f} | {rank} | {name} "
                         f"| {run['checkpointing']} | {'on' if run['activation_offload'] else 'off'} "
                         f"| {run['micro_batch']} x {run['grad_accum']} | {run['memory_bytes'] / 2**20:.1f} "
                         f"| {(result['budget'] + run['host_bytes']) / 2**20:.1f} | {held} | {predicted} "
                         f"| {measured} | {verdict} |")
    return "\n".join(lines)


def gathered(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def ranks(args) -> None:
    import shardengine as se

    se.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        answer = gathered(plan(args, seq_len, world) if rank == 0 else None)[0]
        rows = measure(args, answer)
        for row in rows:  # the slowest rank sets the pace; the most any rank held
            if row.get("times"):
                everyone = gathered((row["times"], row["held"]))
                row["times"] = [max(t) for t in zip(*(times for times, _ in everyone))]
                row["held"] = max(held for _, held in everyone)
        summary(rows)
        results.append({**{k: answer[k] for k in ("seq_len", "budget", "no_lever_bytes", "timed")},
                        "lines": answer.get("lines", []), "rows": rows})
        if rank == 0:
            print(f"seq {seq_len}: budget {answer['budget'] / 2**20:.1f} MiB per rank "
                  f"({args.budget_fraction:g} of the {answer['no_lever_bytes'] / 2**20:.1f} MiB no lever fits in)\n  "
                  + "\n  ".join(answer.get("lines", ["no plan fits"])), flush=True)
    if rank == 0:
        print(table(results))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))


def main() -> int:
    args = parse()
    if under_launcher():
        ranks(args)
        return 0
    env = {}
    if args.calibration != "none":
        path = Path(args.calibration)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "memory_estimator.cli", "calibrate", "--nproc", str(args.nproc),
                            "--out", str(path)], check=True)
        env["SHARDENGINE_CALIBRATION"] = str(path.resolve())
    else:  # rank by the levers' cost: no calibration may be found
        env["SHARDENGINE_CALIBRATION"] = str(Path(tempfile.mkdtemp()) / "none.json")
    return relaunch(__file__, args.nproc, env=env)


if __name__ == "__main__":
    sys.exit(main())
