"""Ranks that hang or die: a clear error within the collective timeout, and recovery by restart.

* A rank is SIGKILLed at each named point of a save (``checkpoint_crashes.py``,
  forked 2-rank groups): ``latest`` always loads, bit-exact, and holds the
  previous or the in-flight checkpoint, including when the step ``latest``
  names is saved again.
* A rank stalls mid-step: its peer stops with a ``CollectiveError`` naming the
  collective within ``shard(..., timeout_s=...)``. A dedicated pool, because
  the stalled ranks end out of step and the pool is torn down afterwards.
* A rank is SIGKILLed mid-training under ``torchrun --max-restarts=3``: the
  group restarts, resumes from ``latest`` and finishes with parameters
  bit-identical to a run that was never interrupted (run in the shared pool,
  same code path: ``checkpoint_cases.train_with_checkpoints``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import torch

import checkpoint_cases as cases
from preloaded_python import ForkedPython
from rank_pool import RankPool, RankPoolRegistry

HERE = os.path.dirname(os.path.abspath(__file__))  # this test's folder: its case scripts
ENGINE_TIMEOUT_S = 3.0


def test_peer_of_a_hanging_rank_stops_within_the_timeout() -> None:
    with RankPool(2, collective_timeout_s=5) as pool:
        results = pool.run(cases.hang_mid_step, ENGINE_TIMEOUT_S, 1, ENGINE_TIMEOUT_S + 4, timeout=60)
    survivor = results[0]
    assert survivor["is_collective_error"], survivor
    assert "reduce_scatter (as all_reduce)" in survivor["message"] and "timeout is 3s" in survivor["message"]
    assert ENGINE_TIMEOUT_S - 0.5 <= survivor["seconds"] <= ENGINE_TIMEOUT_S + 4, survivor["seconds"]


def _torchrun(python: ForkedPython, args: list[str], log_dir: str) -> subprocess.CompletedProcess:
    command = [python.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=3", "--monitor-interval=0.2", os.path.join(HERE, "checkpoint_cases.py"),
               *args]
    return subprocess.run(command, cwd=log_dir, env=python.env, capture_output=True, text=True, timeout=150)


def test_killed_rank_recovers_under_torchrun(rank_pools: RankPoolRegistry, tmp_path, forked_python) -> None:
    common = ["--stage", "2", "--steps", "8", "--checkpoint-every", "2", "--timeout-s", "10"]
    reference = rank_pools.get(2).run(
        cases.reference_run, common + ["--checkpoint-dir", str(tmp_path / "reference")])[0]
    marker, out = tmp_path / "killed", tmp_path / "final.pt"
    started = time.perf_counter()
    done = _torchrun(forked_python, common + ["--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out),
                               "--kill-rank", "1", "--kill-at-step", "5", "--marker", str(marker)],
                     str(tmp_path))
    elapsed = time.perf_counter() - started
    log = done.stdout + done.stderr
    (tmp_path / "torchrun.log").write_text(log)
    errors = [line for line in log.splitlines() if "Error" in line and "[rank" in line]
    assert done.returncode == 0, "\n".join(errors[:20]) + log[-3000:]
    assert marker.read_text().startswith("killed rank 1 at step 5, attempt 0"), log[-2000:]
    assert "resumed from step 4 (attempt 1)" in log, log[-4000:]
    final = torch.load(out, weights_only=True)
    assert cases.same(final, reference), "the restarted run's final parameters differ"
    print(f"kill-a-rank: rank 1 SIGKILLed at step 5, torchrun restarted the group, resumed from "
          f"step 4, final parameters bit-identical; {elapsed:.1f} s")


def test_kill_at_every_point_of_a_save_leaves_latest_loadable(tmp_path, forked_python) -> None:
    done = subprocess.run([forked_python.python, os.path.join(HERE, "checkpoint_crashes.py"), str(tmp_path)],
                          env=forked_python.env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["failures"] == [], json.dumps(summary["failures"], indent=1)
    outcomes = summary["outcomes"]
    resaves = [o for o in outcomes if o["kind"] == "resave" and o["rank"] == 0]
    # Every point of a re-save was tried, including the window where the old copy is replaced.
    assert [o["point"] for o in resaves] == summary["resave_points"]
    assert {"latest -> step_2.previous", "moved aside", "renamed"} <= set(summary["resave_points"])
    assert {o["latest"] for o in outcomes if o["killed"]} == {"previous", "new"}
    assert any(o["rank"] == 1 and o["killed"] for o in outcomes)
    print(f"{summary['trials']} trials, {sum(o['killed'] for o in outcomes)} kills, "
          f"{summary['seconds']} s: latest always loaded bit-exact")
