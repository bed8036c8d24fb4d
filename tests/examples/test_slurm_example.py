"""The SLURM example builds the multi-node torchrun command from SLURM's environment.

``srun`` and ``scontrol`` are stand-ins on PATH that record what they were asked, so the
script runs here without a cluster: what it would launch on each node is checked.
"""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train_multinode.sbatch"


def _stand_in(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_sbatch_script_launches_one_agent_per_node_with_a_c10d_rendezvous(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.args"
    _stand_in(bin_dir / "scontrol", 'test "$1 $2 $3" = "show hostnames gpu[07-10]" && printf "gpu07\\ngpu08\\n"\n')
    _stand_in(bin_dir / "srun", f'printf "%s\\n" "$@" > {record}\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-10]",
           "SLURM_NNODES": "4", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "8"}
    done = subprocess.run(["bash", str(SCRIPT), "--stage", "3"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "4 nodes x 8 ranks, rendezvous gpu07:29500" in done.stdout
    args = record.read_text().splitlines()
    assert args[:3] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "python"]
    for expected in ("--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:29500",
                     "--rdzv-id=4242", "--max-restarts=3"):
        assert expected in args, (expected, args)
    assert args[-3:] == ["examples/train_gpt.py", "--stage", "3"]
