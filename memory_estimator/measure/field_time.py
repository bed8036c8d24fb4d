"""The time model held against published, measured training throughput.

    python -m memory_estimator.measure.field_time tests/field/throughput.json

A throughput field file is JSON: ``{"runs": [run, ...]}``; each run names its source
(``url``, ``where``, ``quote``), the model (``params`` with ``hidden``/``layers``/``heads``/
``vocab``, or ``config``), the setup as ``estimate()`` keyword arguments, the cluster
(``nodes``, ``gpus_per_node``, ``interconnect``), ``grad_accum``, the ``plan`` that ran,
and what was measured: ``{"value": 4641, "unit": "tokens/s/gpu"}``. Nothing is fitted
per run: the defaults (efficiency by generation and size, the links' catalog figures)
are the estimator's own.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..api import estimate
from ..plan.timed import TimingRequest, time_estimate
from ..request import EstimateRequest
from .field import _model_arguments, load_runs


@dataclass(frozen=True)
class ThroughputResult:
    run: dict
    measured: float      # tokens/s per GPU
    predicted: float

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
    return ThroughputResult(run, float(run["measured"]["value"]), time.tokens_per_s / world)


def evaluate(path: str | Path) -> list[ThroughputResult]:
    runs, base = load_runs(path)
    return [evaluate_run(run, base) for run in runs]


def format_rows(results: Sequence[ThroughputResult], markdown: bool = False) -> str:
    header = ["run", "GPUs", "device", "measured tok/s/GPU", "predicted", "error"]
    rows = [[r.run["id"], str(r.run["cluster"]["nodes"] * r.run["cluster"]["gpus_per_node"]),
             r.run["setup"]["device"], f"{r.measured:,.0f}", f"{r.predicted:,.0f}", f"{r.error:+.1%}"]
            for r in results]
    errors = [abs(r.error) for r in results]
    tail = f"{len(results)} runs  median |error| {statistics.median(errors):.1%}  worst {max(errors):.1%}"
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows] + ["", tail])
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    render = lambda row: "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths))  # noqa: E731
    return "\n".join([render(header)] + [render(row) for row in rows] + ["", tail])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memory_estimator.measure.field_time",
                                     description="Time model vs published measured training throughput.")
    parser.add_argument("path", help="a throughput field file, e.g. tests/field/throughput.json")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    print(format_rows(evaluate(args.path), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
