"""The time model held against published, measured training throughput.

    python -m memory_estimator.measure.field_time tests/field/throughput.json

A throughput field file is JSON: ``{"runs": [run, ...]}``; each run names its source
(``url``, ``where``, ``quote``), the model (``params`` with ``hidden``/``layers``/``heads``/
``vocab``, or ``config``), the setup as ``estimate()`` keyword arguments, the cluster
(``nodes``, ``gpus_per_node``, ``interconnect``), ``grad_accum``, the ``plan`` that ran,
and what was measured: ``{"value": 4641, "unit": "tokens/s/gpu"}``, and its ``split``:
``calibration`` (the runs the one constant taken from runs, ``SUSTAINED_FRACTION`` in
``hardware/achievable.py``, is derived from: ``--derive`` prints it) or ``held-out`` (no
constant was taken from them; the model is judged on these). Nothing is fitted per run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from ..api import estimate
from ..hardware.achievable import SUSTAINED_FRACTION
from ..hardware.devices import CATALOG as DEVICES
from ..plan.timed import TimingRequest, time_estimate
from ..request import EstimateRequest
from ..timing.step import operation_times
from .field import _model_arguments, load_runs

if TYPE_CHECKING:
    from ..timing.step import StepTime


@dataclass(frozen=True)
class ThroughputResult:
    run: dict
    measured: float      # tokens/s per GPU
    predicted: float
    time: Optional["StepTime"] = None
    operations: tuple[tuple[str, float], ...] = ()   # seconds per micro-step by operation name

    @property
    def split(self) -> str:
        return self.run.get("split", "held-out")

    @property
    def generation(self) -> str:
        device = DEVICES.get(self.run["setup"]["device"])
        return device.generation if device is not None else "unknown"

    @property
    def dominant(self) -> str:
        """The two operations (``timing/operations.py``) taking most of a micro-step, and their shares."""
        if not self.operations:
            return ""
        total = sum(seconds for _, seconds in self.operations)
        ranked = sorted(self.operations, key=lambda pair: -pair[1])[:2]
        return ", ".join(f"{name} {seconds / total:.0%}" for name, seconds in ranked)

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def _timing_request(run: dict) -> TimingRequest:
    cluster = run["cluster"]
    return TimingRequest(nodes=cluster["nodes"], gpus_per_node=cluster["gpus_per_node"],
                         interconnect=cluster.get("interconnect"), intra_node=cluster.get("intra_node"),
                         grad_accum=run.get("grad_accum", 1))


def evaluate_run(run: dict, base: Path) -> ThroughputResult:
    model = run["model"]
    if "params" in model and "hidden" in model:
        model_args = {key: model[key] for key in ("params", "hidden", "layers", "heads", "vocab")}
    else:
        model_args = _model_arguments(run, base)
    cluster = run["cluster"]
    world = cluster["nodes"] * cluster["gpus_per_node"]
    # A field file states the run in estimate()'s flat keywords.
    result = estimate(EstimateRequest.from_keywords(**model_args, world_size=world,
                                                    grad_accum=run.get("grad_accum", 1), **run["setup"]))
    timed = time_estimate(result, _timing_request(run))
    names = [plan.name for plan in timed.plans]
    time = timed.times[names.index(run["plan"])]
    return ThroughputResult(run, float(run["measured"]["value"]), time.tokens_per_s / world, time,
                            _by_operation(timed.workload, timed.cluster))


def _by_operation(workload, cluster) -> tuple[tuple[str, float], ...]:
    """Seconds per micro-step of each operation, forward, backward and recomputation together."""
    totals: dict[str, float] = {}
    for op, seconds in operation_times(workload, cluster):
        name = op.name.removeprefix("recompute ")
        totals[name] = totals.get(name, 0.0) + seconds
    return tuple(totals.items())


def evaluate(path: str | Path) -> list[ThroughputResult]:
    runs, base = load_runs(path)
    return [evaluate_run(run, base) for run in runs]


def summary(results: Sequence[ThroughputResult]) -> str:
    errors = [abs(r.error) for r in results]
    if not errors:
        return "0 runs"
    return f"{len(results)} runs  median |error| {statistics.median(errors):.1%}  worst {max(errors):.1%}"


def format_rows(results: Sequence[ThroughputResult], markdown: bool = False) -> str:
    header = ["run", "split", "GPUs", "device", "measured tok/s/GPU", "predicted", "error", "dominant"]
    rows = [[r.run["id"], r.split, str(r.run["cluster"]["nodes"] * r.run["cluster"]["gpus_per_node"]),
             r.run["setup"]["device"], f"{r.measured:,.0f}", f"{r.predicted:,.0f}", f"{r.error:+.1%}", r.dominant]
            for r in results]
    tail = [f"{split}: {summary([r for r in results if r.split == split])}" for split in ("held-out", "calibration")]
    tail.append(f"all: {summary(results)}")
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows] + [""] + tail)
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    render = lambda row: "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths))  # noqa: E731
    return "\n".join([render(header)] + [render(row) for row in rows] + [""] + tail)


def derive_sustained(results: Sequence[ThroughputResult]) -> dict[str, float]:
    """Per generation, over its calibration runs, the median share of the measured step's compute
    time (measured step less the predicted optimizer step and exposed communication) that the
    operations account for at a sustained fraction of 1; rounded to two places."""
    shares: dict[str, list[float]] = {}
    for r in results:
        if r.split != "calibration" or r.time is None:
            continue
        t, world = r.time, r.run["cluster"]["nodes"] * r.run["cluster"]["gpus_per_node"]
        measured_step = t.tokens_per_step / world / r.measured
        mechanisms = t.compute_s * SUSTAINED_FRACTION.get(r.generation, 1.0)
        shares.setdefault(r.generation, []).append(mechanisms / (measured_step - t.optimizer_s - t.exposed_comm_s))
    return {generation: round(statistics.median(values), 2) for generation, values in sorted(shares.items())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memory_estimator.measure.field_time",
                                     description="Time model vs published measured training throughput.")
    parser.add_argument("path", help="a throughput field file, e.g. tests/field/throughput.json")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--derive", action="store_true",
                        help="print the sustained fraction per generation derived from the calibration split")
    args = parser.parse_args(argv)
    results = evaluate(args.path)
    print(format_rows(results, args.markdown))
    if args.derive:
        print(f"derived from the calibration split: SUSTAINED_FRACTION = {derive_sustained(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
