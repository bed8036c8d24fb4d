"""The estimator held against published, measured per-GPU peaks of real training runs.

    python -m memory_estimator.measure.field tests/field/runs.json             # one row per run, then by engine
    python -m memory_estimator.measure.field tests/field/runs.json --markdown  # the tables of docs/field-accuracy.md

A field file is JSON: ``{"runs": [run, ...]}``. Each run names its source (``url``,
``where``: the table or figure), the model (``config``: a path relative to the file or
an inline config; or ``params``), the setup as ``estimate()`` keyword arguments
(``engine``, ``world_size``, ``precision``/``amp``, ``micro_batch``, ``seq_len``,
``checkpointing``, ``device``, ...), the ``plan`` that ran, and what was measured:
``{"value": 82.4, "unit": "GiB", "metric": "reserved"}``.

Metrics (see ``overheads.py``): ``allocated`` (``max_memory_allocated``, "peak memory
active") is compared with the plan's total less the CUDA context, NCCL and what the
caching allocator holds without a tensor in it (fragmentation, segments cached for other
lengths or moments: ``RESERVED_ONLY``); ``reserved`` (``max_memory_reserved``) with the
total less the context and NCCL; ``nvidia-smi`` with the whole total. A run that trained must never be
called "does not fit" at the default safety margin.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..api import Estimate, estimate
from ..basis import comparable_bytes
from ..request import EstimateRequest

_UNITS = {"GiB": 2**30, "MiB": 2**20, "GB": 10**9, "MB": 10**6}


@dataclass(frozen=True)
class FieldResult:
    """One run: what it measured, what the estimator says (its point and range on the run's
    metric), and the verdict it gives."""

    run: dict
    measured: int
    predicted: int
    verdict: str
    low: int = 0
    high: int = 0

    @property
    def varying_lengths(self) -> bool:
        setup = self.run["setup"]
        return setup.get("length_histogram") is not None or setup.get("mean_seq_len") is not None

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    @property
    def engine(self) -> str:
        return self.run["setup"].get("engine", "shardengine")


def comparable_range(result: Estimate, plan_name: str, metric: str) -> tuple[int, int]:
    """The plan's range (``confidence.py``) as the run's metric counts memory."""
    from ..plan.memory import RESERVED_ONLY

    plan = result.plan(plan_name)
    point = comparable_bytes(result, plan_name, metric)
    if plan.confidence is None:
        return point, point
    skipped = {"cuda_context", "nccl_buffers"} if metric != "nvidia-smi" else set()
    if metric == "allocated":
        skipped |= set(RESERVED_ONLY)
    counted = [t for t in plan.confidence.terms if t.term not in skipped]
    return (point + sum(t.low - t.bytes for t in counted), point + sum(t.high - t.bytes for t in counted))


def _model_arguments(run: dict, base: Path) -> dict[str, Any]:
    model = run["model"]
    if "config" in model:
        config = model["config"]
        if isinstance(config, str):
            config = json.loads((base / config).read_text())
        return {"config": {**config, **model.get("override", {})}}
    return {"params": model["params"], "largest_layer": model.get("largest_layer")}


def _setup_arguments(run: dict, base: Path) -> dict[str, Any]:
    """The run's setup as ``estimate()`` keywords; files it names (a length histogram, a DeepSpeed
    config) are relative to the field file."""
    setup = dict(run["setup"])
    for key in ("length_histogram", "deepspeed_config"):
        if isinstance(setup.get(key), str):
            setup[key] = str(base / setup[key])
    return setup


def evaluate_run(run: dict, base: Path) -> FieldResult:
    # A field file states the run in estimate()'s flat keywords.
    result = estimate(EstimateRequest.from_keywords(**_model_arguments(run, base), **_setup_arguments(run, base)))
    measured = run["measured"]
    value = int(round(measured["value"] * _UNITS[measured["unit"]]))
    plan = result.plan(run["plan"])
    low, high = comparable_range(result, run["plan"], measured["metric"])
    return FieldResult(run, value, comparable_bytes(result, run["plan"], measured["metric"]), plan.verdict, low, high)


def load_runs(path: str | Path) -> tuple[list[dict], Path]:
    path = Path(path)
    return json.loads(path.read_text())["runs"], path.parent


def evaluate(path: str | Path) -> list[FieldResult]:
    runs, base = load_runs(path)
    return [evaluate_run(run, base) for run in runs]


def summary(results: Sequence[FieldResult]) -> dict[str, tuple[int, float, float]]:
    """engine -> (runs, median |error|, worst |error|), plus "all"."""
    groups: dict[str, list[float]] = {}
    for result in results:
        groups.setdefault(result.engine, []).append(abs(result.error))
        groups.setdefault("all", []).append(abs(result.error))
    order = sorted(name for name in groups if name != "all") + ["all"]
    return {name: (len(groups[name]), statistics.median(groups[name]), max(groups[name])) for name in order}


def _gib(value: int) -> str:
    return f"{value / 2**30:.1f}"


def format_rows(results: Sequence[FieldResult], markdown: bool = False) -> str:
    header = ["run", "engine", "plan", "GPU", "measured GiB", "metric", "predicted GiB", "range", "error", "verdict"]
    rows = [[r.run["id"], r.engine, r.run["plan"], r.run["setup"].get("device", "?"), _gib(r.measured),
             r.run["measured"]["metric"], _gib(r.predicted),
             _gib(r.low) + "–" + _gib(r.high) if r.low != r.high else "", f"{r.error:+.1%}", r.verdict]
            for r in results]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["", "| engine | runs | median abs error | worst abs error |", "|---|---|---|---|"]
        lines += [f"| {name} | {n} | {median:.1%} | {worst:.1%} |" for name, (n, median, worst) in summary(results).items()]
        return "\n".join(lines)
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    render = lambda row: "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths))  # noqa: E731
    lines = [render(header)] + [render(row) for row in rows] + [""]
    lines += [f"{name:12s} {n:3d} runs  median |error| {median:6.1%}  worst {worst:6.1%}"
              for name, (n, median, worst) in summary(results).items()]
    return "\n".join(lines)


def format_sources(path: str | Path) -> str:
    runs, _ = load_runs(path)
    return "\n".join(f"- `{run['id']}`: {run['source']['where']} — {run['source']['url']}" for run in runs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memory_estimator.measure.field",
                                     description="Estimator vs published measured per-GPU peak memory.")
    parser.add_argument("path", help="a field file (JSON), e.g. tests/field/runs.json")
    parser.add_argument("--markdown", action="store_true", help="markdown tables and the sources")
    args = parser.parse_args(argv)
    results = evaluate(args.path)
    print(format_rows(results, args.markdown))
    if args.markdown:
        print("\nSources:\n" + format_sources(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
