"""The activation-plan benchmark runs at a tiny size: it plans, runs the ranked plans, and each
run holds no more than its plan promised.

One subprocess (the benchmark starts its own 2 ranks; no calibration, so the planner ranks by
the levers' cost). The table of a real run is in docs/memory.md.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from rank_pool import REPO_ROOT

SCRIPT = Path(REPO_ROOT) / "benchmarks" / "bench_activation_plan.py"


def test_tiny_run_plans_runs_the_ranked_plans_within_what_they_promised(tmp_path, forked_python):
    out = tmp_path / "plan.json"
    done = subprocess.run([forked_python.python, str(SCRIPT), "--layers", "2", "--width", "32", "--seq-lens", "128",
                           "--rounds", "2", "--budget-fraction", "0.8", "--calibration", "none", "--json", str(out)],
                          env=forked_python.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["budget"] < result["no_lever_bytes"]  # nothing fits without a lever
    assert any(line.startswith("micro-batch: ") for line in result["lines"])  # the printed plan
    ran = [row for row in result["rows"] if "skipped" not in row]
    assert ran and len(result["rows"]) <= 3
    for row in ran:
        assert 0 < row["held"] <= row["promised"], row
        assert row["median_s"] > 0 and len(row["times"]) == 2
    assert "| 128 |" in done.stdout  # the table
