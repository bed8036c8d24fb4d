"""Prediction vs measurement: train real steps with shardengine and compare per-rank peak memory.

    python -m memory_estimator.measure.validate                      # GPT tiny/1m/10m + MLP, stages 0-3, N=2
    python -m memory_estimator.measure.validate --models gpt-tiny --stages 0,3 --precision fp32,bf16 --json

For every (model, stage, precision) the estimator is asked about the live module
before it is sharded; then the engine trains it and one rank of N is measured:

- World size N > 1 runs in this one process on a fake process group
  (``torch.testing._internal.distributed.fake_pg``): collectives are no-ops, which
  changes no allocation, so the memory is one rank's of N.
- params / grads / optimizer states: ``memory_report()`` at the start of a step, with the
  gradient storage kept between steps (``zero_grad(set_to_none=False)``), so ``grads`` is
  what a rank holds from backward to the optimizer step, where the peak is.
- transient (activations + working set): the peak, during one step (forward, backward,
  optimizer step, zero_grad), of bytes allocated since the step began. On CPU it is
  read from the allocator's events (``torch.profiler`` with ``profile_memory``): every
  tensor allocation and free, including the storage ``resize_`` stage 3 gathers
  parameters with, which a ``TorchDispatchMode`` does not see. On CUDA it is
  ``torch.cuda.max_memory_allocated()`` minus the bytes allocated at the step's start.
- measured total = model states + transient; predicted total = the plan's total with
  zero overheads (no CUDA context or allocator fragmentation on CPU; pass
  ``--cuda-overheads`` on a GPU to include the default ones).

A warm-up step runs first (Adam's state is created by the first step); then the
worst of ``--steps`` measured steps is reported. Exit code 1 when any row's total
misses ``--tolerance`` (default 10%).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import shardengine as se
from shardengine.testing.models import MLP, build_gpt, example_inputs

from ..api import estimate
from ..request import EngineRequest, EstimateRequest, ModelRequest, TargetRequest, TrainingRequest
from ..engines.shardengine_exact import EngineOptions
from ..plan.memory import Overheads

MiB = 2**20
STAGE_PLANS = ("ddp", "zero1", "zero2", "zero3")
# A fake process group sends nothing: no NCCL buffers whatever the device.
NO_OVERHEADS = Overheads(cuda_context_bytes=0, fragmentation_fraction=0.0, logits_in_overhead=False, nccl_bytes=0)


# ---------------------------------------------------------------------- models


class Regression(nn.Module):
    """An MLP trained on mean-squared error, so ``forward(x, y)`` returns the loss."""

    def __init__(self, sizes: Sequence[int]):
        super().__init__()
        self.net = MLP(sizes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def _gpt_inputs(vocab: int) -> Callable[[int, int], tuple]:
    return functools.partial(example_inputs, vocab_size=vocab)


def _mlp_inputs(sizes: Sequence[int]) -> Callable[[int, int], tuple]:
    def make(micro_batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(micro_batch, sizes[0], generator=gen),
                torch.randn(micro_batch, sizes[-1], generator=gen))
    return make


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A model to validate on: how to build it, its inputs and the batch it trains with."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int], tuple]
    micro_batch: int
    seq_len: int


def _gpt(preset: str, micro_batch: int, seq_len: int, vocab: int = 256) -> ModelCase:
    return ModelCase(f"gpt-{preset}", functools.partial(build_gpt, preset, vocab_size=vocab, seq_len=seq_len),
                     _gpt_inputs(vocab), micro_batch, seq_len)


_MLP_SIZES = (509, 1021, 1021, 1021, 127)  # primes: every bucket and shard is padded


MODELS: dict[str, Callable[[], ModelCase]] = {
    "gpt-tiny": lambda: _gpt("tiny", micro_batch=8, seq_len=64),
    "gpt-1m": lambda: _gpt("1m", micro_batch=8, seq_len=128),
    "gpt-10m": lambda: _gpt("10m", micro_batch=4, seq_len=256),
    "mlp": lambda: ModelCase("mlp", functools.partial(Regression, _MLP_SIZES), _mlp_inputs(_MLP_SIZES), 256, 1),
}


# ---------------------------------------------------------------------- measuring


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """One rank (rank 0) of ``world_size`` in this process; collectives do nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("validate needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class PeakSinceStart:
    """Peak bytes allocated above the level at ``__enter__``, on CPU or the current CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self) -> "PeakSinceStart":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._quiet = _without_native_lines(BENIGN_PROFILER_LINES)
            self._quiet.__enter__()
            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._start
            return
        try:
            self._profile.__exit__(*exc_info)
        finally:
            self._quiet.__exit__(None, None, None)
        events = [e for e in self._profile.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        live = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            self.peak = max(self.peak, live)


# What the CPU profiler prints on its own while it runs: kineto's start/stop markers, and
# c10's note on frees of blocks allocated before profiling began (expected: the step
# frees tensors made earlier, and the peak is taken above the step's start anyway).
BENIGN_PROFILER_LINES = ("SyncActivityProfilerHandler.cpp", "allocated before the profiling started")


@contextlib.contextmanager
def _without_native_lines(benign: Sequence[str]) -> Iterator[None]:
    """Capture the process's stderr (fd 2, where C++ logs go); re-emit all but ``benign`` lines."""
    import os
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not any(marker in line for marker in benign):
                    sys.stderr.write(line)
            sys.stderr.flush()


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple) -> None:
    loss = model(*inputs)
    loss.backward()
    del loss
    optimizer.step()
    # set_to_none=False keeps the gradient storage (zeroed) between steps, so memory_report()
    # at the start of a step counts the gradients a rank holds from backward to the step, and
    # the peak above that start is the step's transient alone, not the gradients again.
    optimizer.zero_grad(set_to_none=False)


def measure(case: ModelCase, stage: int, world_size: int, precision: str, steps: int,
            device: torch.device) -> dict[str, int]:
    """Per-rank bytes by term, measured while the engine trains ``case`` at ``stage``."""
    module = case.build().to(device)
    options = {} if precision == "fp32" else {"param_dtype": precision}
    model, optimizer = se.shard(module, torch.optim.AdamW(module.parameters(), lr=1e-4), stage=stage, **options)
    inputs = tuple(t.to(device) for t in case.inputs(case.micro_batch, case.seq_len))
    _train_step(model, optimizer, inputs)  # warm-up: creates the optimizer state
    report, transient = model.memory_report(), 0
    for _ in range(steps):
        gc.collect()
        gc.disable()  # no collection of unrelated garbage inside the measured step
        try:
            report = model.memory_report()
            with PeakSinceStart(device) as peak:
                _train_step(model, optimizer, inputs)
        finally:
            gc.enable()
        transient = max(transient, peak.peak)
    return {"params": report.params, "grads": report.grads, "optimizer_states": report.optimizer_states,
            "transient": transient, "total": report.model_states + transient}


def predict(case: ModelCase, stage: int, world_size: int, precision: str, overheads: Overheads,
            device: torch.device | None = None) -> dict[str, int]:
    """The estimator's per-rank terms for the live module (not touched), before it is sharded.

    N > 1 runs on the fake process group, whose backend takes the communicator's native
    path, so stage 1 reduces through slice buffers; N = 1 reduces in place.
    """
    result = estimate(EstimateRequest(
        ModelRequest(module=case.build(), example_inputs=case.inputs),
        # torch's default step: foreach on CUDA, the for-loop on CPU
        TrainingRequest(world_size=world_size, precision=precision, optimizer="adamw",
                        optimizer_impl="foreach" if device is not None and device.type == "cuda" else "plain",
                        micro_batch=case.micro_batch, seq_len=case.seq_len),
        engine=EngineRequest(options=EngineOptions(reduces_in_place=world_size == 1)),
        target=TargetRequest(device_memory_bytes=2**50, overheads=overheads)))
    plan = result.plan(STAGE_PLANS[stage])
    return {"params": plan.params, "grads": plan.grads, "optimizer_states": plan.optimizer_states,
            "activations": plan.activations, "working_set": plan.working_set, "overhead": plan.overhead,
            "transient": plan.activations + plan.working_set + plan.overhead, "total": plan.total}


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    stage: int
    world_size: int
    precision: str
    predicted: dict[str, int]
    measured: dict[str, int]
    seconds: float

    @property
    def rel_error(self) -> float:
        return (self.predicted["total"] - self.measured["total"]) / self.measured["total"]

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "stage": self.stage, "world_size": self.world_size,
                "precision": self.precision, "predicted": self.predicted, "measured": self.measured,
                "rel_error": self.rel_error, "seconds": self.seconds}


def run(models: Sequence[str], stages: Sequence[int], world_size: int, precisions: Sequence[str],
        steps: int = 1, overheads: Overheads = NO_OVERHEADS, device: torch.device | None = None,
        on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Every (model, precision, stage) row, predicted vs measured, on one rank of ``world_size``."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    rows = []
    with fake_world(world_size):
        for name in models:
            case = MODELS[name]()
            for precision in precisions:
                for stage in stages:
                    started = time.perf_counter()
                    predicted = predict(case, stage, world_size, precision, overheads, device)
                    measured = measure(case, stage, world_size, precision, steps, device)
                    rows.append(Row(case.name, stage, world_size, precision, predicted, measured,
                                    time.perf_counter() - started))
                    if on_row:
                        on_row(rows[-1])
    return rows


# ---------------------------------------------------------------------- report

_HEADER = (f"{'model':<9} {'stage':>5} {'N':>2} {'prec':>4} | {'predicted':>10} {'measured':>10} {'error':>7} | "
           f"{'params':>15} {'grads':>15} {'optim':>15} {'act+work':>15}")


def _mib(value: int) -> str:
    return f"{value / MiB:.2f}"


def format_row(row: Row) -> str:
    terms = " ".join(f"{_mib(row.predicted[t]) + '/' + _mib(row.measured[t]):>15}"
                     for t in ("params", "grads", "optimizer_states", "transient"))
    return (f"{row.model:<9} {row.stage:>5} {row.world_size:>2} {row.precision:>4} | "
            f"{_mib(row.predicted['total']):>10} {_mib(row.measured['total']):>10} {row.rel_error:>+7.1%} | {terms}")


def worst(rows: Sequence[Row]) -> Row:
    return max(rows, key=lambda row: abs(row.rel_error))


def _csv(kind: Callable[[str], Any], choices: Sequence[Any]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = [kind(part) for part in text.split(",") if part]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(map(str, choices))}; got {text!r}")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m memory_estimator.measure.validate",
                                     description="Predicted vs measured per-rank peak memory of shardengine training.")
    parser.add_argument("--models", type=_csv(str, list(MODELS)), default=list(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} (default all)")
    parser.add_argument("--stages", type=_csv(int, (0, 1, 2, 3)), default=[0, 1, 2, 3], help="default 0,1,2,3")
    parser.add_argument("--world-size", type=int, default=2, help="ranks N; one rank is measured (default 2)")
    parser.add_argument("--precision", type=_csv(str, ("fp32", "bf16")), default=["fp32"],
                        help="fp32 and/or bf16 (mixed, fp32 masters); default fp32")
    parser.add_argument("--steps", type=int, default=1, help="measured steps after one warm-up (default 1)")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed |relative error| of the total")
    parser.add_argument("--cuda-overheads", action="store_true",
                        help="include the estimator's default CUDA context and fragmentation overheads")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world_size < 1 or args.steps < 1:
        print("error: --world-size and --steps must be >= 1", file=sys.stderr)
        return 2
    if not args.json:
        print(f"per-rank memory, MiB (predicted/measured), one rank of N={args.world_size}; "
              f"tolerance ±{args.tolerance:.0%}")
        print(_HEADER, flush=True)
    on_row = None if args.json else (lambda row: print(format_row(row), flush=True))
    rows = run(args.models, args.stages, args.world_size, args.precision, args.steps,
               Overheads() if args.cuda_overheads else NO_OVERHEADS, on_row=on_row)
    bad = [row for row in rows if abs(row.rel_error) > args.tolerance]
    if args.json:
        print(json.dumps({"tolerance": args.tolerance, "rows": [row.as_dict() for row in rows],
                          "worst": worst(rows).as_dict(), "ok": not bad}, indent=1))
    else:
        print(f"worst row: {format_row(worst(rows))}")
        print(f"{len(rows) - len(bad)}/{len(rows)} rows within ±{args.tolerance:.0%}"
              + ("" if not bad else f"; outside: {', '.join(f'{r.model} stage {r.stage} {r.precision}' for r in bad)}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
