"""``examples/grpo_rollout.py`` runs end to end: 2 trainer ranks (stage 3) and one rollout process
outside their group; each iteration syncs the weights over the weight group (several buckets under
the cap), prints the numerics report, generates on the rollout and trains."""
from __future__ import annotations

import os
import re
import subprocess

from rank_pool import REPO_ROOT


def test_grpo_rollout_example_syncs_generates_and_trains(tmp_path, forked_python) -> None:
    command = [forked_python.python, os.path.join(REPO_ROOT, "examples", "grpo_rollout.py"), "--iterations", "3"]
    env = forked_python.env
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    syncs = re.findall(r"iteration (\d): sync (\d+): [\d.]+ MiB in (\d+) buckets.*mean \|Δ\| ([\d.e-]+).*"
                       r"(explained by the dtype|NOT explained)", log)
    assert [int(s[1]) for s in syncs] == [1, 2, 3], log[-3000:]
    for _, _, buckets, mean, verdict in syncs:
        assert int(buckets) >= 3                       # the cap split the model
        assert 0 < float(mean) < 0.05                  # a bf16 rollout of the fp32 trainer: small, not zero
        assert verdict == "explained by the dtype"
    assert len(re.findall(r"iteration \d: mean reward [\d.]+, loss", log)) == 3
    assert re.search(r"done: 3 iterations; each sync held at most (\d+) bytes per rank \(cap (\d+)\)", log)
