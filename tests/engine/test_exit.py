"""Training scripts end cleanly: exit code 0 on every rank, every time.

An abort at interpreter exit (a Gloo thread freeing a finished work without
the GIL: SIGABRT, "terminate called without an active exception") happened
in a few runs out of ten when a process group outlived
``destroy_process_group()``. Two checks:

* deterministic: after ``destroy_process_group()`` no process group object is
  left alive, even while the sharded model still exists (``exit_cases.py``);
* end to end: the example's shutdown path (stage 3, a checkpoint, the exported
  full state dict, destroy) under torchrun, several runs, every exit code checked;
* a restart after the last checkpoint (the first of those runs started again, as
  ``torchrun --max-restarts`` would) exits 0 with a summary; ``--steps`` below the checkpoint's step is refused (exit code 2).
  (The rank pool checks its own workers' exits at the end of the session.)
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Optional

import pytest
import torch
from preloaded_python import ForkedPython
from rank_pool import REPO_ROOT  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))  # this test's folder: its case scripts
EXAMPLE_RUNS = 2  # each ~6 s here; the cause itself is checked deterministically above


def _torchrun(python: ForkedPython, script_and_args: list[str], cwd: str, timeout: int = 180) -> subprocess.CompletedProcess:
    command = [python.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--monitor-interval=0.2", *script_and_args]
    return subprocess.run(command, cwd=cwd, env=python.env, capture_output=True, text=True, timeout=timeout)


def test_destroy_process_group_frees_every_group(tmp_path, forked_python) -> None:
    done = _torchrun(forked_python, [os.path.join(HERE, "exit_cases.py"), str(tmp_path)], str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert report["world_held_by"] == [], report
        assert report["world_freed"], f"rank {rank}: the default group outlived destroy_process_group()"
        assert report["engine_group_freed"], f"rank {rank}: the engine's group outlived destroy_process_group()"


SCRIPT = os.path.join(REPO_ROOT, "examples", "train_gpt.py")
LAST_STEP = 3  # the runs' --steps, and the step of their last checkpoint


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory, forked_python) -> list[tuple[list[str], subprocess.CompletedProcess]]:
    """(arguments, outcome) of each of EXAMPLE_RUNS runs of the example's shutdown path; the restart
    test resumes the first one's checkpoint, so no run trains only to be restarted."""
    runs = []
    for run in range(EXAMPLE_RUNS):
        out = tmp_path_factory.mktemp(f"example_{run}")
        args = ["--stage", "3", "--preset", "tiny", "--steps", str(LAST_STEP), "--micro-batch", "2", "--seq-len", "32",
                "--log-every", "1", "--eval-batches", "1", "--checkpoint-dir", str(out / "ckpt"),
                "--checkpoint-every", str(LAST_STEP), "--export", str(out / "weights.pt")]
        runs.append((args, _torchrun(forked_python, [SCRIPT, *args], str(out))))
    return runs


def _clean_exit_problem(name: str, done: subprocess.CompletedProcess, export: str) -> Optional[str]:
    log = done.stdout + done.stderr
    if done.returncode != 0 or "terminate called" in log:
        return f"{name}: exit code {done.returncode}\n{log[-2000:]}"
    if not torch.load(export, weights_only=True):
        return f"{name}: the exported state dict is empty"
    return None


def test_example_shutdown_path_exits_cleanly_every_time(example_runs) -> None:
    failures = [_clean_exit_problem(f"run {run}", done, args[-1]) for run, (args, done) in enumerate(example_runs)]
    assert not any(failures), "\n\n".join(filter(None, failures))


def test_a_restart_after_the_last_checkpoint_exits_0_with_a_summary(example_runs, tmp_path, forked_python) -> None:
    args = example_runs[0][0]
    again = _torchrun(forked_python, [SCRIPT, *args], str(tmp_path), timeout=300)  # as --max-restarts would
    log = again.stdout + again.stderr
    assert _clean_exit_problem("the restart", again, args[-1]) is None, log[-3000:]
    assert f"at step {LAST_STEP}" in log and "training already complete" in log and "Traceback" not in log
    assert "summary" in log and "validation loss" in log
    below = [*args[:args.index("--steps") + 1], "1", *args[args.index("--steps") + 2:]]
    below = subprocess.run([forked_python.python, SCRIPT, *below], cwd=str(tmp_path), env=forked_python.env,
                           capture_output=True, text=True, timeout=300)
    assert below.returncode == 2, (below.stdout + below.stderr)[-3000:]
    assert f"--steps 1 is below step {LAST_STEP} of the checkpoint" in below.stderr and "--resume never" in below.stderr
    assert "Traceback" not in below.stderr and f"{LAST_STEP}/1" not in below.stdout
