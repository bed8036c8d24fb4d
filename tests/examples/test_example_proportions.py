"""The example's uneven data: ``--proportions 0.7,0.3`` / ``auto`` and the demo's ``--slow-rank``.

The batch stream is checked in-process (every rank's micro-batch follows its
share, all ranks make the same number of micro-steps, no sample twice in an
epoch); one 2-rank torchrun run checks that ``auto`` moves work off a slowed rank.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from rank_pool import REPO_ROOT

EXAMPLES = os.path.join(REPO_ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import train_gpt  # noqa: E402
from data.shares import ProportionalBatches, Windows, rank_batch_sizes  # noqa: E402

import shardengine as se  # noqa: E402


def test_each_rank_takes_its_share_of_every_global_micro_batch_and_no_sample_twice_per_epoch() -> None:
    proportions, global_batch = [.25, .25, .10, .40], 20
    windows = Windows(torch.arange(40 * 8 + 1), seq_len=8)  # 40 windows: two global batches an epoch
    ranks = [ProportionalBatches(windows, global_batch, proportions, seed=3, rank=r, num_replicas=4)
             for r in range(4)]
    assert [r.batch_size for r in ranks] == [5, 5, 2, 8]
    assert {r.steps_per_epoch() for r in ranks} == {2}
    for epoch in range(2):
        drawn = [r.next() for r in ranks for _ in range(2)]
        starts = [int(x[0]) // 8 for inputs, _ in drawn for x in inputs]
        assert len(starts) == len(set(starts)) == 40, f"epoch {epoch}: a window was drawn twice"
        for inputs, targets in drawn:
            assert torch.equal(inputs[:, 1:], targets[:, :-1])  # next-token targets
    with pytest.raises(se.ConfigError, match="rank 2's share 0 .* is 0 sequences"):
        rank_batch_sizes(20, [.5, .5, 0, 0])


def test_bad_flags_are_clear_errors() -> None:
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--proportions", "0.7;0.3"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--slow-factor", "0.5"])
    assert train_gpt.parse_args(["--proportions", "0.7,0.3"]).proportions == [0.7, 0.3]
    assert train_gpt.parse_args(["--proportions", "auto"]).proportions == "auto"


def test_auto_proportions_move_work_off_the_rank_measured_slower(tmp_path, forked_python) -> None:
    """``--slow-rank 1`` slows rank 1's work, but a loaded machine may slow rank 0 more (a run on a
    busy machine measured the unslowed rank at 71.9 ms and the slowed one at 40.4). So the test
    reads the times the re-balancer acted on from its own log line and checks what it did with
    them: the rank measured slower loses work, and the shares follow the measured speeds. It
    never assumes which process the machine made faster."""
    command = [forked_python.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--monitor-interval=0.2", os.path.join(EXAMPLES, "train_gpt.py"), "--preset", "tiny",
               "--steps", "8", "--micro-batch", "4", "--seq-len", "32", "--log-every", "4", "--eval-batches", "1",
               "--proportions", "auto", "--auto-window", "2", "--auto-rounds", "1",
               "--slow-rank", "1", "--slow-factor", "4"]
    env = forked_python.env
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    rebalanced = re.search(r"step 3: re-balanced \(round 1/1\): work ms/step ([\d.]+)/([\d.]+) at shares "
                           r"0\.500/0\.500 -> shares ([\d.]+)/([\d.]+), micro-batches (\d+)/(\d+)", log)
    assert rebalanced, log[-3000:]
    times = [float(rebalanced[1]), float(rebalanced[2])]
    shares, batches = [float(rebalanced[3]), float(rebalanced[4])], [int(rebalanced[5]), int(rebalanced[6])]
    # Equal shares before, no smoothing: the shares become the measured speeds, normalized, no rank
    # below the floor of one sequence of the global batch of 8 (examples/data/shares.py, ShareTuner);
    # the log rounds the times to 0.1 ms and the shares to 0.001.
    expected = se.data.rebalance_proportions([0.5, 0.5], step_times=times, smoothing=0.0, floor=1.01 * 2 / 8)
    assert shares == pytest.approx(expected, abs=0.01), rebalanced[0]
    slower = max(range(2), key=lambda r: times[r])
    if abs(times[0] - times[1]) > 0.05 * max(times):  # measurably different: work moves off the slower
        assert shares[slower] < 0.5 < shares[1 - slower] and batches[slower] < batches[1 - slower], rebalanced[0]
    assert re.search(rf"shares {shares[0]:.3f}/{shares[1]:.3f} \(micro-batches \d+/\d+\) from step 5: "
                     r"[\d.]+ ms/step", log)
    assert re.search(r"shares 0\.500/0\.500 \| micro-batch 4/4 \| work ms/step", log)  # the first log line
