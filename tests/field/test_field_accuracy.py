"""The estimator against published, measured per-GPU peaks of real training runs (runs.json).

Each run keeps its source (URL and the table or log it comes from), its full setup and
what the measurement counts (allocated, reserved or nvidia-smi; see
``memory_estimator/measure/field.py``). The setups are the runs' own; nothing here is fitted to
them: the memory model has no constant taken from runs, so every run is ``held-out``. Runs
whose batches vary in length are judged by their point (the median over shuffled orders) and
carry the range the answer states. ``python -m memory_estimator.measure.field tests/field/runs.json``
prints the table.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from memory_estimator.measure.field import evaluate, format_rows, load_runs

RUNS = Path(__file__).parent / "runs.json"
# published runs under-predicted by more than 20% whose mechanism is not modelled yet, each with its diagnosis
OPEN = Path(__file__).parent / "runs_open.json"


@pytest.fixture(scope="module")
def results():
    return evaluate(RUNS)


def test_every_run_names_its_source_setup_and_metric():
    runs, _ = load_runs(RUNS)
    assert len({run["id"] for run in runs}) == len(runs) >= 40
    for run in runs:
        assert run["source"]["url"].startswith("https://") and run["source"]["where"]
        assert run["measured"]["metric"] in ("allocated", "reserved", "nvidia-smi")
        assert {"engine", "world_size", "device"} <= set(run["setup"])
        assert run.get("split", "held-out") == "held-out"   # no memory constant is taken from any run


def test_open_runs_name_their_source_and_gap_and_are_not_also_scored():
    runs, _ = load_runs(RUNS)
    open_runs, _ = load_runs(OPEN)
    assert not {run["id"] for run in open_runs} & {run["id"] for run in runs}
    for run in open_runs:
        assert run["source"]["url"].startswith("https://") and run["source"]["where"] and run["open"]
        assert run["measured"]["metric"] in ("allocated", "reserved", "nvidia-smi")
        assert {"engine", "world_size", "device"} <= set(run["setup"])


def test_median_error_within_10_percent(results):
    assert statistics.median(abs(result.error) for result in results) <= 0.10, format_rows(results)


def test_no_prediction_is_more_than_20_percent_below_its_measurement(results):
    low = [(r.run["id"], f"{r.error:+.1%}") for r in results if r.error < -0.20]
    assert low == [], format_rows(results)


def test_fixed_length_runs_within_25_percent_either_way(results):
    fixed = [abs(r.error) for r in results if not r.varying_lengths]
    assert len(fixed) >= 30 and max(fixed) <= 0.25, format_rows(results)


def test_varying_length_runs_carry_their_range(results):
    varying = [r for r in results if r.varying_lengths]
    assert len(varying) >= 15
    for r in varying:
        assert r.low <= r.predicted <= r.high
    # the order of the batches is not known: a range, unless the device's memory cuts it
    assert sum(r.low < r.high for r in varying) >= 15


def test_no_run_that_trained_is_called_does_not_fit(results):
    assert [r.run["id"] for r in results if r.verdict == "does not fit"] == []
