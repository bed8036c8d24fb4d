"""Per-rank memory between steps and inside forward, backward and step: torch's engines beside shardengine's stages.

    python benchmarks/bench_memory_floor.py                     # launches 2 ranks on CPU itself, ~1 minute
    python benchmarks/bench_memory_floor.py --batch small --json out.json

One run, one :class:`~shardengine.testing.allocator_tracker.AllocatorTracker` per rank
over all of it (every CPU allocation and free, storage ``resize_`` included). The
engines, one after another in the same processes, on the same GPT (``build_gpt(preset,
seed=0)``), the same batch and AdamW everywhere, bf16 compute with fp32 master weights:

* ``ddp``: torch DDP, forward under ``torch.autocast("cpu", torch.bfloat16)``;
* ``zero``: ``ZeroRedundancyOptimizer`` over DDP, autocast;
* ``fsdp2``: ``fully_shard`` per block and the root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=...)``;

``--reduce-dtype`` (fp32 by default) is the gradient reduction's dtype for FSDP2 and shardengine
alike, so the two reduce the same bytes: shardengine's own default is ``param_dtype`` (bf16),
as FSDP2's is, and comparing it against an FSDP2 that reduces in fp32 flatters it by the
gradient buffers' halved size. DDP and ZeRO reduce the fp32 gradients autocast leaves.
* ``fsdp2-sgo``: the same with ``reshard_after_forward=False`` (FSDP's SHARD_GRAD_OP, ZeRO-2's
  layout: parameters stay gathered from forward to the end of backward), stage 2's peer;
* ``s0``..``s3``: ``se.shard(stage=K, param_dtype="bf16", reduce_dtype=...)``;
* ``s3-sgo``: stage 3 with ``reshard_after_forward=False``, shardengine's SHARD_GRAD_OP (the
  layout of ``fsdp2-sgo``: each unit gathered at its forward, freed after its backward);
  ``s2`` keeps DeepSpeed ZeRO-2's layout (the compute-dtype parameters whole on every rank
  between steps too), so ``ds2`` is the engine that holds what it holds;
* ``s1i``..``s3i``: the same with ``step_in_backward=True`` (the step, and its peak, inside
  backward; their *step peak* is that of ``optimizer.step()``, which then only runs hooks);
* ``ds1``..``ds3`` when deepspeed is installed: ``deepspeed.initialize`` with ZeRO stage K,
  ``bf16`` enabled and torch's AdamW (its training loop: ``engine.backward``, ``engine.step``,
  which zeroes the gradients itself).

Per engine, after one warm-up step: *between* = bytes alive after
``optimizer.zero_grad(set_to_none=True)``, before the next forward; *fwd / bwd / step
peak* = the most bytes alive at once inside that phase of the next step. Each counts
the blocks allocated since just before the engine's model was built (after
``gc.collect()``), so the engine's model states, its buffers and the activations,
and nothing left by the previous engine. Each figure is the maximum over
ranks, and the least over ``--repeat`` measurements: a free made on a thread the profiler
does not follow is counted only once its address is reused (the tracker's Note), which only
adds bytes. For shardengine ``memory_report().model_states`` (between steps) is printed beside
it: the tracker sees every byte, so *between* is at least that.

``--batch small`` (model states dominate the peak) and ``--batch large`` (activations
count), or ``both`` (the default). ``--json PATH`` writes the rows and ratios.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardengine as se  # noqa: E402
from shardengine.testing.allocator_tracker import AllocatorTracker  # noqa: E402
from shardengine.testing.models import build_gpt, example_inputs, lm_loss  # noqa: E402
from launch import relaunch, under_launcher  # noqa: E402  benchmarks/launch.py

MIB = 2**20
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
ENGINES = ["ddp", "zero", "fsdp2", "fsdp2-sgo", "s0", "s1", "s2", "s3", "s3-sgo"]
IN_BACKWARD_ENGINES = ["s1i", "s2i", "s3i"]  # shard(step_in_backward=True)
DEEPSPEED_ENGINES = ["ds1", "ds2", "ds3"]  # measured when deepspeed is installed
# DeepSpeed's default buckets (5e8 elements) are allocated whole, ~1 GB at bf16 for any model;
# at DDP's default of 25 MiB of fp32 gradients its communication buffers are sized like torch's.
DEEPSPEED_BUCKET_ELEMENTS = 25 * 2**20 // 4
BATCHES = {"small": (1, 32), "large": (8, 128)}  # (micro-batch, sequence length)
PHASES = ["between", "forward", "backward", "step"]
# Each stage against the torch engine that holds what it holds (ZeRO paper's correspondence),
# and against DeepSpeed's same stage when it ran.
PEAK_PAIRS = [("s0", "ddp"), ("s1", "zero"), ("s2", "fsdp2-sgo"), ("s2", "fsdp2"), ("s3", "fsdp2"),
              ("s3-sgo", "fsdp2-sgo"), ("s1", "ds1"), ("s2", "ds2"), ("s3", "ds3")]


class Built:
    """One engine ready to train: the model to call, its optimizer, how to run a step, how to free it."""

    def __init__(self, model, optimizer, autocast: bool, free: Callable[[], None] = lambda: None) -> None:
        self.model, self.optimizer, self.autocast, self.free = model, optimizer, autocast, free

    def forward_context(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class BuiltDeepSpeed(Built):
    """A DeepSpeed engine: ``engine.backward(loss)``, ``engine.step()`` (which also zeroes the gradients)."""

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)

    def step(self) -> None:
        self.model.step()

    def zero_grad(self) -> None:
        pass  # engine.step() has zeroed them, as DeepSpeed's training loop expects


def build_deepspeed(model: torch.nn.Module, stage: int, micro_batch: int) -> Built:
    """DeepSpeed ZeRO ``stage`` with bf16 compute (fp32 master weights and AdamW state), torch's AdamW.

    [Note: DeepSpeed on CPU without its C++ extensions]
    ``deepspeed.initialize`` on CPU compiles the ``deepspeed_shm_comm`` extension on first
    use (minutes, and a stale build lock hangs every later run); marked incompatible,
    DeepSpeed falls back to plain torch.distributed (Gloo here). A torch optimizer
    instance keeps it from building its fused CPU Adam."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    buckets = {key: DEEPSPEED_BUCKET_ELEMENTS for key in
               ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")}
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **buckets},
              "zero_allow_untested_optimizer": True}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW),
                                                   config=config)
    return BuiltDeepSpeed(engine, optimizer, autocast=False, free=engine.destroy)


def build_engine(name: str, args, micro_batch: int) -> Built:
    """The GPT wrapped by engine ``name``, with AdamW."""
    model = build_gpt(args.preset, vocab_size=args.vocab, seq_len=args.seq_len, seed=0, n_layer=args.layers)
    adamw = functools.partial(torch.optim.AdamW, **ADAMW)
    if name.startswith("ds"):
        return build_deepspeed(model, int(name[2]), micro_batch)
    if name.startswith("s"):
        wrapped, optimizer = se.shard(model, adamw, stage=int(name[1]), param_dtype="bf16",
                                      reduce_dtype=args.reduce_dtype, bucket_mb=args.bucket_mb,
                                      step_in_backward=name in IN_BACKWARD_ENGINES,
                                      reshard_after_forward=name != "s3-sgo")
        return Built(wrapped, optimizer, autocast=False, free=wrapped.engine.remove_hooks)
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        reduce_dtype = torch.float32 if args.reduce_dtype == "fp32" else torch.bfloat16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        reshard = name == "fsdp2"  # fsdp2-sgo keeps the gathered parameters until backward ends
        for block in model.blocks:  # one unit per block, then the root
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        return Built(model, adamw(model.parameters()), autocast=False)
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model)
    if name == "ddp":
        return Built(ddp, adamw(ddp.parameters()), autocast=True)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    return Built(ddp, zero, autocast=True)


def train_step(built: Built, batch, tracker: Optional[AllocatorTracker] = None, prefix: str = "") -> None:
    """forward, backward, step, zero_grad (set_to_none=True); with a tracker each phase is marked."""
    mark = (lambda phase: tracker.phase(prefix + phase)) if tracker else (lambda phase: contextlib.nullcontext())
    idx, targets = batch
    with mark("forward"), built.forward_context():
        loss = lm_loss(built.model(idx), targets)
    with mark("backward"):
        built.backward(loss)
        del loss
    with mark("step"):
        built.step()
    built.zero_grad()


def measure_engine(name: str, setting: str, repeat: int, args, tracker: AllocatorTracker) -> Optional[int]:
    """Warm-up step, then the phases of one step; returns shardengine's model_states (None for torch's)."""
    micro_batch, seq_len = BATCHES[setting]
    batch = example_inputs(micro_batch, seq_len, vocab_size=args.vocab, seed=dist.get_rank())
    prefix = f"{setting}/{name}/{repeat}/"
    gc.collect()
    with tracker.phase(prefix + "base"):
        pass
    built = build_engine(name, args, micro_batch)
    train_step(built, batch)
    gc.collect()  # what reference cycles keep alive goes at the next collection: not held between steps
    with tracker.phase(prefix + "between"):
        pass
    model_states = built.model.memory_report().model_states if name.startswith("s") else None
    train_step(built, batch, tracker, prefix)
    built.free()
    del built
    gc.collect()
    return model_states


def relative_bytes(tracker: AllocatorTracker, setting: str, name: str, repeats: int) -> list[int]:
    """between, forward, backward, step peaks of one engine, of the blocks allocated since it was
    built; each the least over the repeats (a free the tracker misses only adds bytes)."""
    return [min(figures) for figures in zip(*(relative_bytes_once(tracker, f"{setting}/{name}/{repeat}/")
                                              for repeat in range(repeats)))]


def relative_bytes_once(tracker: AllocatorTracker, prefix: str) -> list[int]:
    """Bytes of the blocks allocated since the engine's build began (the tracker's Note)."""
    base = prefix + "base"
    return ([tracker.live_at_start_of(prefix + "between", since=base)]
            + [tracker.peak_in(prefix + phase, since=base) for phase in PHASES[1:]])


def max_over_ranks(values: list[int]) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """The comparisons the memory floor is judged by: stage 3 vs FSDP2 between steps, each stage vs its torch
    peer at peak, and each stage with the step inside backward vs FSDP2 at peak (of the engines that ran)."""
    peak = {name: max(row["bytes"][1:]) for name, row in rows.items()}
    out = {"s3/fsdp2 between": rows["s3"]["bytes"][0] / rows["fsdp2"]["bytes"][0]} if {"s3", "fsdp2"} <= set(rows) else {}
    pairs = PEAK_PAIRS + [(ours, "fsdp2") for ours in IN_BACKWARD_ENGINES]  # s3i/fsdp2: the floor gone below
    out.update({f"{ours}/{peer} peak": peak[ours] / peak[peer] for ours, peer in pairs if {ours, peer} <= set(peak)})
    return out


def render(setting: str, result: dict, psi: int, world: int) -> str:
    micro_batch, seq_len = BATCHES[setting]
    unit = psi / world
    lines = [f"--batch {setting}: micro-batch {micro_batch} x {seq_len} tokens per rank, Ψ = {psi:,}, N = {world}; "
             "MiB per rank (max over ranks), relative to before the engine was built",
             f"{'engine':>9} | {'between':>8} | {'fwd peak':>8} | {'bwd peak':>8} | {'step peak':>9} | "
             f"{'between B/param':>15} | {'between Ψ/N':>11} | {'peak Ψ/N':>8} | {'model_states':>12}"]
    for name, row in result["rows"].items():
        between, *peaks = row["bytes"]
        states = f"{row['model_states'] / MIB:12.2f}" if row["model_states"] is not None else f"{'-':>12}"
        lines.append(f"{name:>9} | " + " | ".join(f"{b / MIB:8.2f}" for b in (between, *peaks[:2]))
                     + f" | {peaks[2] / MIB:9.2f} | {between / psi:15.2f} | {between / unit:11.2f} | "
                     f"{max(peaks) / unit:8.2f} | {states}")
    lines.append("ratios: " + ", ".join(f"{key} {value:.3f}" for key, value in result["ratios"].items()))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="10m", help="GPT preset (shardengine.testing.models)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (10m preset with 4: ~7.2M params)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128, help="the model's context length")
    p.add_argument("--batch", default="both", choices=["small", "large", "both"])
    p.add_argument("--engines", default="all",
                   help=f"'all' or a comma list out of {ENGINES + IN_BACKWARD_ENGINES + DEEPSPEED_ENGINES} "
                        "(ds*: DeepSpeed, if installed)")
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the gradient reduction's dtype, for FSDP2's MixedPrecisionPolicy and shardengine's "
                        "reduce_dtype alike (DDP and ZeRO reduce the fp32 gradients autocast leaves)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="shardengine's bucket_mb (stages 0-2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="build and measure each engine this many times; each figure is the least (see the docs)")
    p.add_argument("--nproc", type=int, default=2, help="ranks, when this script launches torchrun itself")
    p.add_argument("--json", help="also write the rows and ratios to this file")
    return p.parse_args(argv)


def deepspeed_installed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    torch.set_num_threads(1)
    se.init_distributed()
    known = ENGINES + IN_BACKWARD_ENGINES + (DEEPSPEED_ENGINES if deepspeed_installed() else [])
    engines = known if args.engines == "all" else args.engines.split(",")
    unknown = [name for name in engines if name not in known]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; known here: {known}")
    settings = ["small", "large"] if args.batch == "both" else [args.batch]
    model_states: dict[tuple[str, str], Optional[int]] = {}
    with AllocatorTracker() as tracker:
        for setting in settings:
            for repeat in range(args.repeat):
                for name in engines:
                    model_states[setting, name] = measure_engine(name, setting, repeat, args, tracker)
    psi = sum(p.numel() for p in build_gpt(args.preset, vocab_size=args.vocab, seq_len=args.seq_len,
                                              n_layer=args.layers).parameters())
    deepspeed_line = ("DeepSpeed ZeRO 1-3: measured (ds1-ds3)" if any(n in engines for n in DEEPSPEED_ENGINES) else
                 "DeepSpeed: not measured (" + ("not asked for" if deepspeed_installed() else "not installed") + ")")
    results = {"psi": psi, "world_size": dist.get_world_size(), "repeat": args.repeat, "deepspeed": deepspeed_line,
               "inferred_frees": max_over_ranks([tracker.inferred_frees])[0], "settings": {}}
    for setting in settings:
        rows = {name: {"bytes": max_over_ranks(relative_bytes(tracker, setting, name, args.repeat)),
                       "model_states": model_states[setting, name]} for name in engines}
        result = {"micro_batch_and_seq_len": BATCHES[setting], "columns": PHASES, "rows": rows}
        result["ratios"] = ratios(rows)  # the pairs whose both engines ran
        results["settings"][setting] = result
    if se.distributed.is_main_process():
        for setting, result in results["settings"].items():
            print(render(setting, result, psi, results["world_size"]) + "\n")
        print(results["deepspeed"])
        print(f"frees the profiler did not report, inferred from reused addresses: {results['inferred_frees']} "
              "(most on one rank; see shardengine/testing/allocator_tracker.py)")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
