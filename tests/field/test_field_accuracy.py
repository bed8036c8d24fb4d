"""The estimator against published, measured per-GPU peaks of real training runs (runs.json).

Each run keeps its source (URL and the table or log it comes from), its full setup and
what the measurement counts (allocated, reserved or nvidia-smi; see
``memory_estimator/measure/field.py``). The setups are the runs' own; nothing here is fitted to
them. ``python -m memory_estimator.measure.field tests/field/runs.json`` prints the table.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from memory_estimator.measure.field import evaluate, format_rows, load_runs

RUNS = Path(__file__).parent / "runs.json"


@pytest.fixture(scope="module")
def results():
    return evaluate(RUNS)


def test_every_run_names_its_source_setup_and_metric():
    runs, _ = load_runs(RUNS)
    assert len({run["id"] for run in runs}) == len(runs) >= 12
    for run in runs:
        assert run["source"]["url"].startswith("https://") and run["source"]["where"]
        assert run["measured"]["metric"] in ("allocated", "reserved", "nvidia-smi")
        assert {"engine", "world_size", "device"} <= set(run["setup"])


def test_median_error_within_10_percent_and_worst_within_25(results):
    errors = [abs(result.error) for result in results]
    table = format_rows(results)
    assert statistics.median(errors) <= 0.10, table
    assert max(errors) <= 0.25, table


def test_no_run_that_trained_is_called_does_not_fit(results):
    assert [r.run["id"] for r in results if r.verdict == "does not fit"] == []
