"""The example's memory lines: the estimate and the measurement of the same terms, side by side.

One 2-rank torchrun run of ``examples/train_gpt.py`` at stage 2: the estimate names its
terms, the memory check after the second step puts each measured figure next to the
estimated one (model states exactly equal; the step's peak beyond them within a few
percent: both count the activations and the gradient bucket), and every log line labels
what its memory figures hold.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from rank_pool import REPO_ROOT  # noqa: E402

NUMBER = r"([\d.]+)"


def _pair(log: str, label: str) -> tuple[float, float]:
    found = re.search(rf"{label} {NUMBER} / {NUMBER}", log)
    assert found, f"no '{label} X / Y' in:\n{log[-3000:]}"
    return float(found[1]), float(found[2])


def test_memory_check_shows_measured_and_estimated_on_the_same_basis(tmp_path, forked_python) -> None:
    command = [forked_python.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--monitor-interval=0.2", os.path.join(REPO_ROOT, "examples", "train_gpt.py"), "--stage", "2",
               "--preset", "1m", "--steps", "2", "--micro-batch", "4", "--seq-len", "128", "--log-every", "1",
               "--eval-batches", "1"]
    env = forked_python.env
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    estimate = re.search(r"estimated peak per rank for zero2: [\d.]+ MiB at the \w+ = model states [\d.]+ "
                         r"\(params [\d.]+, grads [\d.]+, optimizer states [\d.]+\) \+ activations [\d.]+ \+ "
                         r"working set [\d.]+ \+ overhead [\d.]+ MiB", log)
    assert estimate, log[-3000:]
    assert "memory check, rank 0, step 2, MiB measured / estimated (zero2)" in log
    for term in ("model states", "params", "grads", "optimizer states"):
        measured, estimated = _pair(log, term)
        assert measured == estimated > 0, term  # the estimator plans with the engine's own bucket layout
    measured, estimated = _pair(log, "step peak beyond the model states")
    assert abs(measured - estimated) <= 0.05 * estimated, (measured, estimated)
    measured, estimated = _pair(log, "tensors at the peak")
    assert abs(measured - estimated) <= 0.05 * estimated, (measured, estimated)
    log_lines = [line for line in log.splitlines() if line.startswith("step ")]
    assert len(log_lines) == 2
    for line in log_lines:  # labelled: the engine's buffers, not a peak of everything
        assert re.search(r"model states [\d.]+ \(params [\d.]+ grads [\d.]+ optim [\d.]+\), engine buffers peak", line)
        assert not re.search(r"optim [\d.]+ peak", line), line
    # The closing table: the categories a stage-2 run without offload has, no row of zeros for the
    # host and disk tiers or the transient buffers (which zero_grad() has freed by then).
    rows = re.findall(r"^│ (\w+) +│", log, flags=re.MULTILINE)
    assert rows == ["params", "grads", "optimizer_states", "model_states", "total"], rows


def test_memory_table_shows_the_categories_that_apply() -> None:
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from memory_check import table_categories

    import shardengine as se

    device = se.MemoryReport(params=8, grads=0, optimizer_states=16).as_dict()
    assert table_categories([device, device]) == ["params", "grads", "optimizer_states", "model_states", "total"]
    # parameters on the host on one rank only: a row for every rank, zero device rows kept
    on_host = se.MemoryReport(params=0, grads=0, optimizer_states=0, host_params=4, host_optimizer_states=8)
    assert table_categories([device, on_host.as_dict()]) == [
        "params", "grads", "optimizer_states", "host_optimizer_states", "host_params", "model_states", "total"]
