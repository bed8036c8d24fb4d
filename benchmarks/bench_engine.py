#!/usr/bin/env python3
"""Side by side: torch DDP, ZeroRedundancyOptimizer + DDP, FSDP2 and shardengine stages 0-3.

    python benchmarks/bench_engine.py --sizes 10m,27m          # launches torchrun itself (N=2)
    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/bench_engine.py --sizes 10m,27m

Every configuration of one model size lives in the same processes at once and
the timed steps go round-robin over them (several rounds), so machine drift
hits all alike. All use the same model init (``build_gpt(size, seed=0)``), the
same per-rank batches in the same order, and AdamW with the same
hyperparameters. Rank 0 prints a table and PASS/MISS lines for the step-time
targets against the torch anchor of each stage (``TIME_TARGETS``), and writes
``benchmarks/results/bench_engine.json`` and ``.png``.

Per configuration:

* step time: median and IQR over the timed steps (each step between two
  barriers, so it is the slowest rank's time); tokens/s from the median;
  rank-0 phase split (forward / backward / optimizer step + zero_grad) and,
  for ours, seconds inside collectives (``comm_stats().seconds``).
* model-state bytes per rank, measured from the tensors held after
  ``optimizer.step()`` (before ``zero_grad``): parameters, gradients and
  optimizer state, each storage counted once (DTensor local shards for FSDP2,
  the local optimizer for ZeRO, the engine's flat buffers for ours, checked
  against ``memory_report()``), against the ZeRO-paper formula.
* bytes sent per rank per step, ring model: ours from ``comm_stats()``, and for
  every configuration an independent count of the Python-level
  ``torch.distributed`` collectives actually issued (DDP's all-reduce runs in
  its C++ reducer and is not seen; its theory is shown instead), against
  2(N-1)/N*S (stages 0-2) or 3(N-1)/N*S (stage 3), S = one full padded
  gradient copy in the reduce dtype.

``--configs default`` is a subset sized for ~10 minutes on a 2-core CPU box
(bf16 matmuls are ~13x slower than fp32 on CPUs without AVX512-BF16, so only
one bf16 configuration runs by default); ``--configs all`` runs every variant;
or name configurations: ``--configs ddp,fsdp2,s3,s3-bf16``.
``--compile [BACKEND]`` times ``torch.compile`` of the wrapped model against
eager at stages 0 and 3 (docs/compile-and-trainable-set.md).
``--profile s3,fsdp2`` profiles a few steps of those configurations on rank 0
with torch.profiler instead of benchmarking.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import shardengine as se  # noqa: E402
from shardengine.testing.models import GPTConfig, build_gpt, example_inputs, lm_loss  # noqa: E402
from shardengine.flat.plan import count_elements  # noqa: E402
from shardengine.stages.recipes import STAGES  # noqa: E402
from launch import relaunch  # benchmarks/launch.py

MiB = 2**20
RESULTS = ROOT / "benchmarks" / "results"
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


# --------------------------------------------------------------------------- configurations


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration: a torch baseline ('ddp', 'zero', 'fsdp2') or ours (stage 0-3)."""

    name: str
    kind: str                      # "ddp" | "zero" | "fsdp2" | "ours"
    stage: int                     # ZeRO stage it corresponds to (ddp 0, zero 1, fsdp2 3)
    bf16: bool = False
    offload: bool = False
    collectives: str = "auto"   # ours: "auto" (Gloo: in-place primitives) or "native" (forced)
    compiled: bool = False      # ours: torch.compile(wrapped model), backend from --compile
    in_backward: bool = False   # ours: shard(step_in_backward=True), the step inside backward
    params: bool = False        # ours, stage 3: Offload(params=True), every unit's shard on the host

    @property
    def reduce_bytes(self) -> int:
        return 2 if self.bf16 else 4


def _ours(stage: int, bf16: bool = False, offload: bool = False, collectives: str = "auto",
          compiled: bool = False, in_backward: bool = False, params: bool = False) -> Spec:
    suffix = "-bf16" if bf16 else ""
    suffix += "-offload" if offload else ""
    suffix += "-params" if params else ""
    suffix += "-native" if collectives == "native" else ""
    suffix += "-compile" if compiled else ""
    suffix += "-in-backward" if in_backward else ""
    return Spec(f"s{stage}{suffix}", "ours", stage, bf16, offload, collectives, compiled, in_backward, params)


BASELINES = [Spec("ddp", "ddp", 0), Spec("zero", "zero", 1), Spec("fsdp2", "fsdp2", 3)]
ALL_SPECS = (BASELINES + [Spec("fsdp2-bf16", "fsdp2", 3, bf16=True)]
             + [_ours(s) for s in range(4)] + [_ours(s, bf16=True) for s in range(4)]
             + [_ours(s, offload=True) for s in (1, 2, 3)] + [_ours(3, bf16=True, offload=True)]
             + [_ours(3, params=True), _ours(3, bf16=True, params=True)]
             + [_ours(s, collectives="native") for s in (1, 2, 3)]
             + [_ours(s, compiled=True) for s in (0, 3)]
             + [_ours(s, in_backward=True) for s in (1, 2, 3)] + [_ours(3, bf16=True, in_backward=True)])
# s1-native..s3-native force the textbook collectives, so the Gloo choice (comm.py) is measured side by side.
DEFAULT_NAMES = ["ddp", "zero", "fsdp2", "s0", "s1", "s2", "s3", "s1-native", "s2-native", "s3-native",
                 "s3-bf16", "s2-offload"]
SPEC_BY_NAME = {spec.name: spec for spec in ALL_SPECS}


def select_specs(arg: str) -> list[Spec]:
    names = {"default": DEFAULT_NAMES, "all": [s.name for s in ALL_SPECS]}.get(arg, arg.split(","))
    unknown = [n for n in names if n not in SPEC_BY_NAME]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {sorted(SPEC_BY_NAME)}")
    return [SPEC_BY_NAME[n] for n in names]


# --------------------------------------------------------------------------- building


@dataclasses.dataclass
class Runner:
    """A built configuration and what was recorded for it."""

    spec: Spec
    model: nn.Module
    opt: torch.optim.Optimizer
    times: list[list[float]] = dataclasses.field(default_factory=list)   # per round
    phases: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    comm_seconds: list[float] = dataclasses.field(default_factory=list)
    traffic: Optional["Traffic"] = None
    steps_done: int = 0
    last_loss: float = float("nan")

    @property
    def ours(self) -> bool:
        return self.spec.kind == "ours"


def build(spec: Spec, size: str, args, device: torch.device) -> Runner:
    model = build_gpt(size, vocab_size=args.vocab, seq_len=args.seq_len, seed=0).to(device)
    adamw = functools.partial(torch.optim.AdamW, **ADAMW)
    if spec.kind == "ours":
        wrapped, opt = se.shard(model, adamw, stage=spec.stage, param_dtype="bf16" if spec.bf16 else None,
                                offload_optimizer=spec.offload, offload_params=spec.params,
                                collectives=spec.collectives,
                                step_in_backward=spec.in_backward)
        if spec.compiled:  # the warm-up steps absorb the compilation
            wrapped = torch.compile(wrapped, backend=args.compile or "inductor")
        return Runner(spec, wrapped, opt)
    if spec.kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if spec.bf16 \
            else MixedPrecisionPolicy()
        for block in model.blocks:  # one unit per block, then the root
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return Runner(spec, model, adamw(model.parameters()))
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    if spec.kind == "ddp":
        return Runner(spec, ddp, adamw(ddp.parameters()))
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return Runner(spec, ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW))


# --------------------------------------------------------------------------- independent traffic count


@dataclasses.dataclass
class Traffic:
    """Ring-model bytes one rank sent, from the tensors passed to torch.distributed."""

    bytes_by_kind: dict = dataclasses.field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + nbytes

    @property
    def total(self) -> int:
        return sum(self.bytes_by_kind.values())


_TRAFFIC: Optional[Traffic] = None  # where intercepted collectives are counted now (None: nowhere)


def _tbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_tbytes(x) for x in t)
    return t.numel() * t.element_size()


# kind -> (ring factor numerator: all-reduce 2, others 1; which argument holds the full size)
_INTERCEPT = {"all_reduce": (2, 0), "broadcast": (1, 0), "reduce_scatter": (1, 1),
              "reduce_scatter_tensor": (1, 1), "reduce_scatter_single": (1, 1),
              "all_gather": (1, 0), "all_gather_into_tensor": (1, 0), "all_gather_single": (1, 0)}


def install_traffic_counter() -> None:
    """Wrap the Python-level collectives so their bytes are counted into ``_TRAFFIC``."""
    world = dist.get_world_size()
    for name, (factor, arg) in _INTERCEPT.items():
        original = getattr(dist, name, None)
        if original is None:
            continue

        full_size_arg = list(inspect.signature(original).parameters)[arg]

        @functools.wraps(original)
        def counted(*a, _orig=original, _name=name, _factor=factor, _arg=arg, _key=full_size_arg, **kw):
            if _TRAFFIC is not None:
                full = a[_arg] if len(a) > _arg else kw[_key]
                _TRAFFIC.add(_name, _factor * (world - 1) * _tbytes(full) // world)
            return _orig(*a, **kw)
        setattr(dist, name, counted)


# --------------------------------------------------------------------------- one step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(r: Runner, batch, device, record: bool, measure: Optional[Callable] = None) -> None:
    """forward, backward, step, zero_grad; with ``record`` the phase times on this rank."""
    global _TRAFFIC
    x, y = batch
    if record:
        _TRAFFIC = r.traffic
    t0 = time.perf_counter()
    loss = lm_loss(r.model(x), y)
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    r.opt.step()
    if measure is not None:
        measure(r)  # model states as held between step and zero_grad
    r.opt.zero_grad(set_to_none=True)
    _sync(device)
    t3 = time.perf_counter()
    _TRAFFIC = None
    r.steps_done += 1
    r.last_loss = float(loss.detach().float())
    if record:
        for key, value in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            r.phases.setdefault(key, []).append(value)


def timed_step(r: Runner, batch, device, record: bool) -> float:
    """One step between barriers: the slowest rank's time."""
    comm_before = r.model.comm_stats().seconds if r.ours else 0.0
    dist.barrier()
    start = time.perf_counter()
    train_step(r, batch, device, record)
    _sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    if record and r.ours:
        r.comm_seconds.append(r.model.comm_stats().seconds - comm_before)
    return elapsed


# --------------------------------------------------------------------------- model-state bytes from tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


class StorageSum:
    """Bytes of distinct storages (a view into a counted storage adds nothing)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def __call__(self, tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            storage = _local(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def _optimizer_tensors(opt: torch.optim.Optimizer):
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # scalar step counters are not model state
                yield value


def measured_state_bytes(r: Runner) -> dict[str, int]:
    """params / grads / optimizer bytes this rank holds, from the tensors themselves."""
    count = StorageSum()
    if r.ours:
        from shardengine.flat.guard import engine_access

        buckets = r.model.engine.buckets  # read-only look at the engine's flat buffers
        with engine_access():  # sharded parameters refuse reads; this one only sizes storages
            params = count([b.full_param for b in buckets] + [b.kept_shard for b in buckets]
                           + list(r.model.parameters()))
            grads = count([b.full_grad for b in buckets] + [b.grad_shard for b in buckets]
                          + [p.grad for p in r.model.parameters()])
        optim = count([b.master for b in buckets] + list(_optimizer_tensors(r.opt)))
    else:
        model_params = list(r.model.parameters())
        params = count(model_params)
        grads = count([p.grad for p in model_params])
        local_opt = r.opt.optim if r.spec.kind == "zero" else r.opt  # ZeRO: this rank's partition
        optim = count(_optimizer_tensors(local_opt))
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


# --------------------------------------------------------------------------- theory


def zero_formula_bytes(spec: Spec, psi: int, n: int) -> int:
    """ZeRO paper, per rank. fp32: 4+4+8 (no master copy); bf16 or offload: a separate fp32
    master, K = 12 (offload in fp32 keeps 4-byte params and grads next to the host master)."""
    p = g = 2 if spec.bf16 else 4
    k = 12 if (spec.bf16 or spec.offload) else 8  # fp32 parameters on the host are their own master
    return {0: (p + g + k) * psi, 1: (p + g) * psi + k * psi // n,
            2: p * psi + (g + k) * psi // n, 3: (p + g + k) * psi // n}[spec.stage]


def ring_theory_bytes(spec: Spec, padded_elems: int, n: int, in_place_primitives: bool) -> int:
    """Bytes per rank per step for the collectives actually used, in units of (N-1)/N*S:
    stage 0 one all-reduce (2); stages 1-2 a reduce-scatter (1, or 2 when issued as an
    all-reduce) and an all-gather (1, also as broadcasts); stage 3 the same reduction and two
    all-gathers; ZeRO DDP's all-reduce (2) and its parameter broadcast (1). Textbook ZeRO:
    2, 2, 2, 3."""
    reduction = 2 if in_place_primitives else 1
    factor = {"ddp": 2, "zero": 3}.get(spec.kind) or (2 if spec.stage == 0 else reduction + (2 if spec.stage == 3 else 1))
    return factor * (n - 1) * padded_elems * spec.reduce_bytes // n


# --------------------------------------------------------------------------- one size


def make_batches(args, device, rank: int) -> list:
    return [tuple(t.to(device) for t in example_inputs(args.micro_batch, args.seq_len, args.vocab,
                                                      seed=1000 * rank + i))
            for i in range(args.batches)]


def run_size(size: str, specs: list[Spec], args, device, deadline: float) -> dict:
    """Build every configuration, warm up, then round-robin timed steps until done or out of time."""
    n, rank = dist.get_world_size(), dist.get_rank()
    batches = make_batches(args, device, rank)
    log(f"== {size}: building {len(specs)} configurations")
    runners = []
    for spec in specs:
        r = build(spec, size, args, device)
        r.traffic = Traffic()
        runners.append(r)
    for _ in range(args.warmup):
        for r in runners:
            timed_step(r, batches[r.steps_done % len(batches)], device, record=False)
    for r in runners:
        if r.ours:
            r.model.reset_comm_stats()
    size_start, rounds = time.perf_counter(), 0
    slow_every = args.bf16_every if args.bf16_every else (3 if device.type == "cpu" else 1)
    while rounds < args.rounds:
        round_start = time.perf_counter()
        for r in runners:  # the same order each round; drift within a round is one round long
            if r.spec.bf16 and rounds % slow_every:  # slow on CPU: timed every slow_every-th round
                r.times.append([])
                continue
            r.times.append([timed_step(r, batches[r.steps_done % len(batches)], device, record=True)
                            for _ in range(args.steps_per_round)])
        rounds += 1
        round_s = time.perf_counter() - round_start
        log(f"   round {rounds}/{args.rounds}: {round_s:.1f} s")
        out_of_time = torch.tensor([float(time.perf_counter() + round_s * 1.3 > deadline)])
        dist.all_reduce(out_of_time, op=dist.ReduceOp.MAX)  # ranks stop together
        if out_of_time.item() and rounds >= args.min_rounds:
            log(f"   stopping after {rounds} rounds: time budget")
            break
    results = [summarize(r, size, args, device, batches, sum(map(len, r.times)), n) for r in runners]
    del runners
    gc.collect()
    return {"size": size, "rounds": rounds, "steps_per_round": args.steps_per_round, "bf16_every": slow_every,
            "seconds": time.perf_counter() - size_start, "configs": results}


def summarize(r: Runner, size: str, args, device, batches, timed_steps: int, n: int) -> dict:
    """Statistics of one configuration; runs its (untimed) memory-measurement step."""
    spec = r.spec
    ours_comm = r.model.comm_stats() if r.ours else None
    in_place = r.ours and r.model.engine.comm.in_place_primitives  # FSDP2: the textbook collectives
    measured: dict[str, Any] = {}

    def measure(runner: Runner) -> None:
        measured.update(measured_state_bytes(runner))
        if runner.ours:
            report = runner.model.memory_report()
            measured["engine_report"] = report.as_dict()
    train_step(r, batches[r.steps_done % len(batches)], device, record=False, measure=measure)
    loss = torch.tensor([r.last_loss])
    dist.all_reduce(loss)
    flat = [t for round_times in r.times for t in round_times]
    q1, med, q3 = statistics.quantiles(flat, n=4, method="inclusive") if len(flat) > 1 else (flat[0],) * 3
    with torch.device("meta"):
        meta = build_gpt(size, vocab_size=args.vocab, seq_len=args.seq_len)
    psi = GPTConfig.preset(size, vocab_size=args.vocab, seq_len=args.seq_len).num_params()
    # ours: padded flat buffers; torch baselines: unpadded (FSDP2 pads each parameter's dim 0,
    # a few elements at most)
    padded = count_elements(meta, n, STAGES[spec.stage].spec.bucket_shape).padded if spec.kind == "ours" else psi
    out = {
        "name": spec.name, "kind": spec.kind, "stage": spec.stage, "bf16": spec.bf16, "offload": spec.offload, "params": spec.params,
        "params": psi, "timed_steps": timed_steps, "step_times_s": r.times, "median_s": med, "q1_s": q1, "q3_s": q3,
        "tokens_per_s": args.micro_batch * args.seq_len * n / med,
        "phases_median_s": {k: statistics.median(v) for k, v in r.phases.items()},
        "loss_last": loss.item() / n, "state_bytes": measured,
        "zero_formula_bytes": zero_formula_bytes(spec, psi, n),
        "in_place_primitives": bool(in_place),
        "comm_theory_bytes": ring_theory_bytes(spec, padded, n, in_place),
        "intercepted_bytes_per_step": r.traffic.total / timed_steps,
        "intercepted_by_kind": {k: v / timed_steps for k, v in r.traffic.bytes_by_kind.items()},
    }
    if ours_comm is not None:
        out["comm_bytes_per_step"] = ours_comm.bytes_total / timed_steps
        out["comm_by_kind"] = {k: v / timed_steps for k, v in ours_comm.bytes_by_kind.items()}
        out["comm_calls_per_step"] = ours_comm.calls / timed_steps
        out["comm_seconds_median_s"] = statistics.median(r.comm_seconds)
    return out


# --------------------------------------------------------------------------- ratios, targets, report


def add_ratios(size_result: dict) -> None:
    configs = {c["name"]: c for c in size_result["configs"]}
    for c in size_result["configs"]:
        for base in ("ddp", "zero", "fsdp2"):
            if base in configs:
                b = configs[base]
                c[f"vs_{base}"] = c["median_s"] / b["median_s"]
                paired = [statistics.median(x) / statistics.median(y)
                          for x, y in zip(c["step_times_s"], b["step_times_s"]) if x and y]
                c[f"vs_{base}_paired_rounds"] = [min(paired), statistics.median(paired), max(paired)]
        c["state_vs_formula"] = c["state_bytes"]["total"] / c["zero_formula_bytes"]
        measured_comm = sent_per_step(c)
        c["comm_vs_theory"] = measured_comm / c["comm_theory_bytes"] if measured_comm else None


def sent_per_step(c: dict) -> Optional[float]:
    """Bytes sent per step: ours from comm_stats, FSDP2 from the intercepted collectives; DDP's and
    ZeRO's gradient all-reduce runs in DDP's C++ reducer, out of sight (None)."""
    if c["kind"] == "ours":
        return c["comm_bytes_per_step"]
    return c["intercepted_bytes_per_step"] if c["kind"] == "fsdp2" else None


TIME_TARGETS = [("s0", "ddp", 1.05), ("s1", "zero", 1.00), ("s2", "ddp", 1.10), ("s3", "fsdp2", 0.75)]


def targets(size_result: dict) -> list[dict]:
    configs = {c["name"]: c for c in size_result["configs"]}
    size, lines = size_result["size"], []
    for ours, base, limit in TIME_TARGETS:
        if ours in configs and base in configs:
            c = configs[ours]
            lo, mid, hi = c[f"vs_{base}_paired_rounds"]
            lines.append({"size": size, "target": f"{ours} step time <= {limit:.2f}x {base}",
                          "value": c[f"vs_{base}"], "pass": c[f"vs_{base}"] <= limit,
                          "detail": f"{c[f'vs_{base}']:.3f}x (per-round {lo:.2f}..{hi:.2f}, median {mid:.3f})"})
    for c in (c for c in size_result["configs"] if c["kind"] == "ours"):
        ratio = c["state_vs_formula"]
        lines.append({"size": size, "target": f"{c['name']} model states <= 1.02x ZeRO formula",
                      "value": ratio, "pass": ratio <= 1.02,
                      "detail": f"{ratio:.4f}x ({c['state_bytes']['total'] / MiB:.1f} vs "
                                f"{c['zero_formula_bytes'] / MiB:.1f} MiB)"})
        if c["comm_vs_theory"] is not None:  # one rank sends nothing: no ratio to hold
            lines.append({"size": size, "target": f"{c['name']} bytes sent within 1% of ring theory",
                          "value": c["comm_vs_theory"], "pass": abs(c["comm_vs_theory"] - 1) <= 0.01,
                          "detail": f"{c['comm_vs_theory']:.4f}x ({c['comm_bytes_per_step'] / MiB:.2f} vs "
                                    f"{c['comm_theory_bytes'] / MiB:.2f} MiB/step)"})
        report = c["state_bytes"].get("engine_report")
        if report:  # the engine's own accounting against the tensor walk (information, not a target)
            engine_total = (report["model_states"] + report["host_optimizer_states"] + report["host_params"]
                            + report["host_grads"])
            c["engine_report_vs_tensors"] = engine_total / c["state_bytes"]["total"]
    return lines


def table(size_result: dict) -> str:
    head = (f"{'config':<14}{'median s':>9}{'IQR s':>13}{'tok/s':>7}{'xDDP':>6}{'xZeRO':>6}{'xFSDP2':>7}"
            f"{'fwd/bwd/step s':>17}{'comm s':>7}{'states MiB':>11}{'formula':>8}{'x':>6}"
            f"{'MiB sent':>9}{'theory':>8}{'x':>7}{'seen':>7}{'loss':>8}")
    rows = [head, "-" * len(head)]
    for c in size_result["configs"]:
        ph = c["phases_median_s"]
        sent = sent_per_step(c)
        rows.append(
            f"{c['name']:<14}{c['median_s']:>9.3f}{c['q1_s']:>6.3f}-{c['q3_s']:<6.3f}{c['tokens_per_s']:>7.0f}"
            f"{c.get('vs_ddp', float('nan')):>6.2f}{c.get('vs_zero', float('nan')):>6.2f}"
            f"{c.get('vs_fsdp2', float('nan')):>7.2f}"
            f"{ph['forward']:>7.2f}/{ph['backward']:.2f}/{ph['step']:.2f}"
            f"{c.get('comm_seconds_median_s', float('nan')):>7.2f}"
            f"{c['state_bytes']['total'] / MiB:>11.1f}{c['zero_formula_bytes'] / MiB:>8.1f}"
            f"{c['state_vs_formula']:>6.3f}"
            f"{(sent / MiB if sent is not None else float('nan')):>9.1f}{c['comm_theory_bytes'] / MiB:>8.1f}"
            f"{(c['comm_vs_theory'] or float('nan')):>7.3f}{c['intercepted_bytes_per_step'] / MiB:>7.1f}"
            f"{c['loss_last']:>8.4f}")
    return "\n".join(rows)


def chart(results: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); wrote the JSON only"
    sizes = results["sizes"]
    fig, axes = plt.subplots(len(sizes), 3, figsize=(18, 4.2 * len(sizes)), squeeze=False)
    colors = {"ddp": "#777777", "zero": "#999999", "fsdp2": "#bbbbbb", "ours": "#1f77b4"}
    for row, sr in zip(axes, sizes):
        cs = sr["configs"]
        names = [c["name"] for c in cs]
        col = [colors[c["kind"]] if not (c["bf16"] or c["offload"] or c.get("params")) else "#ff7f0e" for c in cs]
        med = [c["median_s"] for c in cs]
        err = [[c["median_s"] - c["q1_s"] for c in cs], [c["q3_s"] - c["median_s"] for c in cs]]
        row[0].bar(names, med, yerr=err, color=col, capsize=3)
        row[0].set_yscale("log")
        row[0].set_title(f"{sr['size']}: median step time (s, log scale), IQR bars")
        row[1].bar(names, [c["state_bytes"]["total"] / MiB for c in cs], color=col, label="measured")
        row[1].scatter(names, [c["zero_formula_bytes"] / MiB for c in cs], color="k", marker="_", s=400,
                       zorder=3, label="ZeRO formula")
        row[1].set_title(f"{sr['size']}: model-state MiB per rank")
        row[1].legend(fontsize=8)
        sent = [(sent_per_step(c) or float("nan")) / MiB for c in cs]
        row[2].bar(names, sent, color=col, label="measured (ours: comm_stats; FSDP2: intercepted)")
        row[2].scatter(names, [c["comm_theory_bytes"] / MiB for c in cs], color="k", marker="_", s=400,
                       zorder=3, label="ring theory")
        row[2].set_title(f"{sr['size']}: MiB sent per rank per step")
        row[2].legend(fontsize=8, loc="upper left")  # DDP's corner: its traffic is not seen, so no bar
        for ax in row[1:]:
            ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom for the legends
        for ax in row:
            ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.suptitle(results["machine"]["note"] + "; grey: torch, blue: ours fp32, orange: ours bf16/offload",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- profile mode


def profile(size: str, specs: list[Spec], args, device) -> None:
    """A few steps of each configuration under torch.profiler on rank 0: where the time goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    batches = make_batches(args, device, dist.get_rank())
    for spec in specs:
        r = build(spec, size, args, device)
        for _ in range(args.warmup):
            timed_step(r, batches[r.steps_done % len(batches)], device, record=False)
        if r.ours:
            r.model.reset_comm_stats()
        ctx = torch_profile(activities=[ProfilerActivity.CPU]) if dist.get_rank() == 0 else contextlib.nullcontext()
        with ctx as prof:
            times = [timed_step(r, batches[r.steps_done % len(batches)], device, record=True)
                     for _ in range(args.profile_steps)]
        if dist.get_rank() == 0:
            ph = {k: statistics.median(v) for k, v in r.phases.items()}
            comm = r.model.comm_stats() if r.ours else None
            print(f"\n### profile {size} {spec.name}: median step {statistics.median(times):.3f} s; "
                  f"forward {ph['forward']:.3f} backward {ph['backward']:.3f} step+zero_grad {ph['step']:.3f}"
                  + (f"; in collectives {comm.seconds / args.profile_steps:.3f} s/step "
                     f"({dict(comm.calls_by_kind)} calls)" if comm else ""), flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows,
                                            max_name_column_width=60), flush=True)
        del r
        gc.collect()


# --------------------------------------------------------------------------- main


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def machine_note(args, device) -> dict:
    n = dist.get_world_size()
    backend = dist.get_backend()
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    load = os.getloadavg()
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {cpu}, {os.cpu_count()} cores"
    note = (f"N={n} {backend} on {dev}; torch {torch.__version__}; {torch.get_num_threads()} thread(s)/rank; "
            f"micro-batch {args.micro_batch} x seq {args.seq_len}, vocab {args.vocab}; "
            f"load avg at start {load[0]:.1f}")
    return {"note": note, "world_size": n, "backend": backend, "device": dev, "torch": torch.__version__,
            "threads_per_rank": torch.get_num_threads(), "loadavg_start": load, "python": platform.python_version()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10m,27m", help="GPT presets, comma separated (10m, 27m, 50m, 100m)")
    p.add_argument("--configs", default="default", help="'default', 'all', or names: " + ",".join(SPEC_BY_NAME))
    p.add_argument("--nproc", type=int, default=2, help="ranks, when this script launches torchrun itself")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batches", type=int, default=4, help="distinct batches per rank, cycled")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    p.add_argument("--rounds", type=int, default=30, help="round-robin rounds over the configurations")
    p.add_argument("--min-rounds", type=int, default=4, help="rounds kept even when over the time budget")
    p.add_argument("--steps-per-round", type=int, default=1)
    p.add_argument("--bf16-every", type=int, default=0,
                   help="time bf16 configurations every k-th round only (0: 3 on CPU, 1 on GPU)")
    p.add_argument("--budget-min", type=float, default=8.5, help="stop adding rounds past this (minutes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--out", default=str(RESULTS / "bench_engine"), help="JSON/PNG path without suffix")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="compiled vs eager: run s0, s0-compile, s3, s3-compile (torch.compile of the "
                        "wrapped model with BACKEND, default inductor; aot_eager needs no C++ compiler)")
    p.add_argument("--profile", default=None, help="profile these configurations instead of benchmarking")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-rows", type=int, default=25)
    return p.parse_args(argv)


def launch_self(args: argparse.Namespace) -> int:
    return relaunch(str(Path(__file__).resolve()), args.nproc, echo=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        return launch_self(args)
    started = time.perf_counter()
    info = se.init_distributed()
    if info.device.type == "cpu":
        torch.set_num_threads(args.threads)
    specs = select_specs(args.profile or ("s0,s0-compile,s3,s3-compile" if args.compile else args.configs))
    sizes = args.sizes.split(",")
    if args.profile:
        for size in sizes:
            profile(size, specs, args, info.device)
        dist.destroy_process_group()
        return 0
    install_traffic_counter()
    results = {"machine": machine_note(args, info.device), "args": vars(args), "sizes": []}
    log(results["machine"]["note"])
    budget_end = started + 60 * args.budget_min
    weights = [GPTConfig.preset(s, vocab_size=args.vocab).num_params() for s in sizes]
    for i, size in enumerate(sizes):  # each size gets a share of the remaining time, by parameters
        share = weights[i] / sum(weights[i:])
        deadline = time.perf_counter() + share * (budget_end - time.perf_counter())
        size_result = run_size(size, specs, args, info.device, deadline)
        add_ratios(size_result)
        size_result["targets"] = targets(size_result)
        results["sizes"].append(size_result)
        log(f"\n{size} ({size_result['configs'][0]['params']:,} params), {size_result['rounds']} rounds x "
            f"{size_result['steps_per_round']} timed steps/config (bf16 every {size_result['bf16_every']}. round):"
            f"\n{table(size_result)}\n")
    results["wall_s"] = time.perf_counter() - started
    if dist.get_rank() == 0:
        report(results, Path(args.out))
    dist.destroy_process_group()
    return 0


def report(results: dict, out: Path) -> None:
    print(f"machine: {results['machine']['note']}")
    lines = [t for sr in results["sizes"] for t in sr["targets"]]
    for t in lines:
        print(f"{'PASS' if t['pass'] else 'MISS'}  [{t['size']}] {t['target']}: {t['detail']}")
    for sr in results["sizes"]:
        off = {c["name"]: round(c["engine_report_vs_tensors"], 4) for c in sr["configs"]
               if abs(c.get("engine_report_vs_tensors", 1.0) - 1) > 0.001}
        print(f"check [{sr['size']}] memory_report() vs tensors held: "
              + (f"DIFFER {off}" if off else "agree within 0.1% for every configuration of ours"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    problem = chart(results, out.with_suffix(".png"))
    print(problem or f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    print(f"total {results['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
