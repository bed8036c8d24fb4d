"""``python -m shardengine.selfcheck`` and the calibration file it writes.

The command runs end to end under a 2-rank launch (here), at world size 1 (the
runnable block of docs/observability.md) and under a 1-rank torchrun (the GPU
script's dry run, tests/selfcheck/test_gpu_check.py); the calibration file changes the estimator's memory and
time answers as documented (docs/observability.md).
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from memory_estimator import estimate
from memory_estimator.hardware.calibration import Calibration, calibrated_overheads, load_calibration, save_calibration
from memory_estimator.cli import main as estimator_main
from memory_estimator.terms.overheads import Overheads
from shardengine.selfcheck.verdict import Check, exit_code, render

GPU_QUERY = dict(params=1e9, world_size=1, device="H100-80GB", micro_batch=1, seq_len=1024)


def _calibration(beta: float = 1e-10, context: int | None = 2 * 2**30, fragmentation: float | None = 0.2):
    return Calibration("nccl", 2, 1e-5, beta, 1e14, 5e13, 1e11, 0.5, cuda_context_bytes=context,
                       fragmentation_fraction=fragmentation)


def test_a_calibration_file_replaces_the_cuda_context_and_fragmentation(tmp_path) -> None:
    path = save_calibration(_calibration(), tmp_path / "calibration.json")
    default = estimate(**GPU_QUERY)
    calibrated = estimate(**GPU_QUERY, calibration=path)
    same_as_flags = estimate(**GPU_QUERY, overheads=Overheads(cuda_context_bytes=2 * 2**30,
                                                              fragmentation_fraction=0.2))
    for name in ("ddp", "zero3"):
        assert calibrated.plan(name).total == same_as_flags.plan(name).total != default.plan(name).total
        assert calibrated.plan(name).buffers["cuda_context"] == 2 * 2**30
    # explicit overheads win over the file
    explicit = estimate(**GPU_QUERY, calibration=path, overheads=Overheads())
    assert explicit.plan("ddp").total == default.plan("ddp").total


def test_a_cpu_calibration_changes_no_memory_answer(tmp_path) -> None:
    path = save_calibration(_calibration(context=None, fragmentation=None), tmp_path / "cpu.json")
    assert calibrated_overheads(path) is None
    assert estimate(**GPU_QUERY, calibration=path).plan("ddp").total == estimate(**GPU_QUERY).plan("ddp").total


def test_a_calibration_without_the_new_fields_still_loads(tmp_path) -> None:
    path = tmp_path / "old.json"
    fields = {"format": 1, "backend": "gloo", "world_size": 2, "alpha_s": 1e-5, "beta_s_per_byte": 1e-9,
              "matmul_flops": 1e10, "training_flops": 1e9, "optimizer_bytes_per_s": 1e9, "overlap": 0.1}
    path.write_text(json.dumps(fields))
    assert load_calibration(path).cuda_context_bytes is None


def _cli_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert estimator_main(argv) == 0
    return json.loads(out.getvalue())


def test_the_cli_reads_the_file_for_memory_and_for_this_machine(tmp_path) -> None:
    slow = save_calibration(_calibration(beta=1e-9), tmp_path / "slow.json")
    fast = save_calibration(_calibration(beta=1e-11), tmp_path / "fast.json")
    base = ["--params", "1e9", "--device", "H100-80GB", "--nodes", "2", "--gpus-per-node", "1",
            "--interconnect", "this-machine", "--json"]
    on_slow, on_fast = _cli_json(base + ["--calibration", str(slow)]), _cli_json(base + ["--calibration", str(fast)])
    assert on_slow["plans"][0]["buffers"]["cuda_context"] == 2 * 2**30
    # the link's seconds per byte come from the file: a 100x slower link, a slower step
    assert on_slow["plans"][0]["time"]["step_time_s"] > on_fast["plans"][0]["time"]["step_time_s"]


def test_a_missing_calibration_file_is_a_clear_error(tmp_path, capsys) -> None:
    code = estimator_main(["--params", "1e9", "--calibration", str(tmp_path / "none.json")])
    assert code == 2 and "no calibration of this machine" in capsys.readouterr().err


def test_the_verdict_fails_when_any_check_fails() -> None:
    ok = [Check("environment", "world", "info", "1 rank"), Check("links", "bus", "skip", "N=1")]
    assert exit_code(ok) == 0
    assert exit_code(ok + [Check("memory", "stage 3", "fail", "+40%")]) == 1
    assert "FAIL" in render(ok + [Check("memory", "stage 3", "fail", "+40%")], "t")
    with pytest.raises(ValueError, match="status"):
        Check("memory", "stage 3", "bad", "")


def _selfcheck(command: list[str], tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "selfcheck.json"
    done = subprocess.run(command + ["--fast", "--json-out", str(report), "--calibration-out",
                                     str(tmp_path / "calibration.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(report.read_text())


def _rows(report: dict, area: str) -> list[dict]:
    return [c for c in report["checks"] if c["area"] == area]


def test_the_selfcheck_passes_under_a_two_rank_launch(tmp_path, forked_python) -> None:
    # the agent and both ranks are forks of the preloaded interpreter, on the CPU (conftest.py)
    done, report = _selfcheck([forked_python.python, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", "-m", "shardengine.selfcheck"], tmp_path, forked_python.env)
    assert {c["name"] for c in _rows(report, "correctness")} >= {f"stage {s} fp32, N=2" for s in range(4)}
    links = {c["name"] for c in _rows(report, "links")}
    assert {f"{kind} bus bandwidth, N=2" for kind in ("all_gather", "reduce_scatter", "all_reduce")} <= links
    assert {f"stage {s} fp32, one rank of N=2" for s in range(4)} <= {c["name"] for c in _rows(report, "memory")}
    calibration = load_calibration(tmp_path / "calibration.json")
    assert calibration.world_size == 2 and {s[0] for s in calibration.samples} == {
        "all_gather", "reduce_scatter", "all_reduce"}


def test_a_memory_row_names_the_terms_that_missed() -> None:
    from shardengine.selfcheck.memory_estimate import memory_row

    measured = {"params": 100, "grads": 100, "optimizer_states": 200, "transient": 600, "total": 1000}
    close = memory_row(2, 2, "fp32", {**measured, "transient": 650, "total": 1050}, measured, 0.10, False)
    assert close.status == "pass" and "largest term miss transient" in close.detail
    far = memory_row(3, 2, "bf16", {**measured, "grads": 300, "transient": 900, "total": 1500}, measured, 0.10, True)
    assert far.status == "fail" and "grads" in far.detail and "transient" in far.detail
    assert "params" not in far.detail.split("terms off")[1]
