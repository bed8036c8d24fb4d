"""benchmarks/gpu_check.py's dry run: the GPU script's whole sequence on the CPU, every step's
figures in one results file. Its processes are forks of the preloaded interpreter
(``forked_python``; the script starts its steps with ``$PYTHON_EXEC``)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_step_and_writes_every_figure(tmp_path, forked_python) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([forked_python.python, str(REPO_ROOT / "benchmarks" / "gpu_check.py"), "--dry-run",
                           "--out", str(out)], env=forked_python.env, capture_output=True, text=True, timeout=600)
    results = json.loads(out.read_text())
    steps = results["steps"]
    failed = {name: step.get("stderr_tail", step)[-1500:] for name, step in steps.items() if step["exit_code"] != 0}
    assert done.returncode == 0 and not failed, failed
    assert list(steps) == ["selfcheck", "cuda_streams", "validate", "engine", "compiled", "offload"]
    selfcheck = steps["selfcheck"]["report"]
    assert selfcheck["exit_code"] == 0 and selfcheck["environment"]["backend"] == "gloo"
    assert {c["area"] for c in selfcheck["checks"]} >= {"environment", "correctness", "device", "memory"}
    assert steps["selfcheck"]["calibration"]["matmul_flops"] > 0
    assert json.loads(steps["cuda_streams"]["stdout_tail"])["ok"]
    assert len(steps["validate"]["rows"]["rows"]) == 4 and steps["validate"]["rows"]["ok"]
    names = lambda step: {c["name"] for c in steps[step]["results"]["sizes"][0]["configs"]}  # noqa: E731
    assert {"ddp", "fsdp2", "s0", "s3", "s3-bf16"} <= names("engine")
    assert {"s0-compile", "s3-compile"} <= names("compiled")
    assert {"s2-offload", "s3-bf16-offload"} <= names("offload")
    for config in steps["engine"]["results"]["sizes"][0]["configs"]:
        assert config["median_s"] > 0 and config["tokens_per_s"] > 0, config["name"]
