"""Training scripts end cleanly: exit code 0 on every rank, every time.

An abort at interpreter exit (a Gloo thread freeing a finished work without
the GIL: SIGABRT, "terminate called without an active exception") happened
in a few runs out of ten when a process group outlived
``destroy_process_group()``. Two checks:

* deterministic: after ``destroy_process_group()`` no process group object is
  left alive, even while the sharded model still exists (``exit_cases.py``);
* end to end: the example's shutdown path (stage 3, a checkpoint, the exported
  full state dict, destroy) under torchrun, several runs, every exit code checked;
* a restart after the last checkpoint (``torchrun --max-restarts``) exits 0 with a
  summary; ``--steps`` below the checkpoint's step is refused (exit code 2).
  (The rank pool checks its own workers' exits at the end of the session.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from rank_pool import REPO_ROOT, scripts_pythonpath  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))  # this test's folder: its case scripts
EXAMPLE_RUNS = 2  # each ~6 s here; the cause itself is checked deterministically above


def _torchrun(script_and_args: list[str], cwd: str, timeout: int = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--monitor-interval=0.2", *script_and_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": scripts_pythonpath()}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_destroy_process_group_frees_every_group(tmp_path) -> None:
    done = _torchrun([os.path.join(HERE, "exit_cases.py"), str(tmp_path)], str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert report["world_held_by"] == [], report
        assert report["world_freed"], f"rank {rank}: the default group outlived destroy_process_group()"
        assert report["engine_group_freed"], f"rank {rank}: the engine's group outlived destroy_process_group()"


def test_example_shutdown_path_exits_cleanly_every_time(tmp_path) -> None:
    failures = []
    for run in range(EXAMPLE_RUNS):
        export = tmp_path / f"weights_{run}.pt"
        done = _torchrun([os.path.join(REPO_ROOT, "examples", "train_gpt.py"), "--stage", "3", "--preset", "tiny",
                          "--steps", "3", "--micro-batch", "2", "--seq-len", "32", "--log-every", "1",
                          "--eval-batches", "1", "--checkpoint-dir", str(tmp_path / f"ckpt_{run}"),
                          "--checkpoint-every", "3", "--export", str(export)], str(tmp_path))
        log = done.stdout + done.stderr
        if done.returncode != 0 or "terminate called" in log:
            failures.append(f"run {run}: exit code {done.returncode}\n{log[-2000:]}")
        elif not torch.load(export, weights_only=True):
            failures.append(f"run {run}: the exported state dict is empty")
    assert not failures, "\n\n".join(failures)


def test_a_restart_after_the_last_checkpoint_exits_0_with_a_summary(tmp_path) -> None:
    script = os.path.join(REPO_ROOT, "examples", "train_gpt.py")
    args = ["--stage", "2", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "32", "--log-every", "1",
            "--eval-batches", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    first = _torchrun([script, *args, "--steps", "2"], str(tmp_path), timeout=300)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    again = _torchrun([script, *args, "--steps", "2"], str(tmp_path), timeout=300)  # as --max-restarts would
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    assert "at step 2" in log and "training already complete" in log and "Traceback" not in log
    assert "summary" in log and "validation loss" in log
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    below = subprocess.run([sys.executable, script, *args, "--steps", "1"], cwd=str(tmp_path), env=env,
                           capture_output=True, text=True, timeout=300)
    assert below.returncode == 2, (below.stdout + below.stderr)[-3000:]
    assert "--steps 1 is below step 2 of the checkpoint" in below.stderr and "--resume never" in below.stderr
    assert "Traceback" not in below.stderr and "2/1" not in below.stdout
