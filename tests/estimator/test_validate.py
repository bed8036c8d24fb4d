"""``python -m memory_estimator.measure.validate``: predicted vs measured peak memory of real training steps.

Runs the command in a subprocess (it creates its own fake process group, which must
not leak into this test process; a fork of the preloaded interpreter, ``forked_python``) on the tiny GPT at stages 0 and 3 with N=2, and
checks the numbers themselves, not only the exit code.
"""
from __future__ import annotations

import json
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 0.10


def test_validate_tiny_gpt_within_tolerance_at_stages_0_and_3(forked_python):
    completed = subprocess.run(
        [forked_python.python, "-m", "memory_estimator.measure.validate", "--models", "gpt-tiny", "--stages", "0,3",
         "--world-size", "2", "--json"],
        cwd=REPO, env=forked_python.env, capture_output=True, text=True, timeout=120)
    payload = json.loads(completed.stdout[completed.stdout.index("{"):])
    rows = payload["rows"]
    assert [(row["model"], row["stage"], row["world_size"]) for row in rows] == [("gpt-tiny", 0, 2), ("gpt-tiny", 3, 2)]
    for row in rows:
        predicted, measured = row["predicted"], row["measured"]
        # Model states are the engine's exact bytes; only the transient part is a prediction.
        for term in ("params", "grads", "optimizer_states"):
            assert predicted[term] == measured[term] > 0, (row["stage"], term)
        assert measured["transient"] > 0 and predicted["activations"] > 0
        assert measured["total"] == measured["params"] + measured["grads"] + measured["optimizer_states"] \
            + measured["transient"]
        error = (predicted["total"] - measured["total"]) / measured["total"]
        assert abs(error) <= TOLERANCE, f"stage {row['stage']}: predicted {predicted} measured {measured}"
        assert row["rel_error"] == error
    by_stage = {row["stage"]: row["measured"] for row in rows}
    assert by_stage[3]["params"] * 2 == by_stage[0]["params"]  # N=2: stage 3 holds half the (padded) params
    assert payload["ok"] and completed.returncode == 0, completed.stderr[-2000:]


def test_validate_exits_nonzero_when_a_row_misses_the_tolerance(forked_python):
    completed = subprocess.run(
        [forked_python.python, "-m", "memory_estimator.measure.validate", "--models", "gpt-tiny", "--stages", "2",
         "--tolerance", "0.0001", "--json"],
        cwd=REPO, env=forked_python.env, capture_output=True, text=True, timeout=120)
    payload = json.loads(completed.stdout[completed.stdout.index("{"):])
    assert completed.returncode == 1 and not payload["ok"]
    assert abs(payload["worst"]["rel_error"]) > 0.0001


def test_profiler_noise_is_dropped_but_other_native_stderr_is_kept(capfd):
    import os
    from memory_estimator.measure.validate import BENIGN_PROFILER_LINES, _without_native_lines

    with _without_native_lines(BENIGN_PROFILER_LINES):
        os.write(2, b"USDT:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"[W CPUAllocator.cpp:245] Memory block of unknown size was allocated before the profiling started\n")
        os.write(2, b"[E something.cpp:1] a real problem\n")
    err = capfd.readouterr().err
    assert "a real problem" in err
    assert "profiler_start" not in err and "allocated before the profiling" not in err
