"""What a checkpoint directory can make us read, and what a failed or crashed save leaves behind.

* ``latest`` and the manifest's file names are confined: ``../``, absolute
  paths and symbolic links out of the checkpoint are refused, and so are the
  directories an interrupted save leaves.
* Every file loads with ``weights_only=True``: ``extra`` round-trips plain
  data, anything else is refused when saving, and a file holding a pickled
  object is refused when loading, without running its code.
* Leftovers of a crashed save are removed by the next save; a failed save
  removes its own; the OS's reason (disk full, file too large) is in the error.

Most cases run in this process at world size 1 (no process group): the paths
and files are the same at any world size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

import checkpoint_cases as cases
from rank_pool import RankPoolRegistry
from shardengine.state.checkpoint import LATEST, MANIFEST, latest_checkpoint, load_checkpoint
from shardengine.errors import CheckpointError
from rank_pool import scripts_pythonpath  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))  # this test's folder: its case scripts


@pytest.fixture
def saved(tmp_path) -> str:
    """A checkpoint directory with step_1 (latest), saved at world size 1, stage 1."""
    ckpt = str(tmp_path / "ckpt")
    cases.train_and_save(1, ckpt, 1)
    return ckpt


def _refused(ckpt: str, phrase: str) -> None:
    result = cases.failed_load(1, ckpt)
    assert result["error"] is not None and phrase in result["error"], result["error"]
    assert result["unchanged"]


# --------------------------------------------------------------------------- confinement


def _point_latest(ckpt: str, target: str) -> None:
    with open(os.path.join(ckpt, LATEST), "w") as f:
        f.write(target + "\n")


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_latest_leading_outside_the_directory_is_refused(saved: str, tmp_path, how: str) -> None:
    elsewhere = tmp_path / "elsewhere" / "step_1"
    shutil.copytree(os.path.join(saved, "step_1"), elsewhere)  # a complete, loadable checkpoint
    if how == "relative":
        _point_latest(saved, "../elsewhere/step_1")
    elif how == "absolute":
        _point_latest(saved, str(elsewhere))
    else:
        os.symlink(elsewhere, os.path.join(saved, "step_7"))
        _point_latest(saved, "step_7")
    _refused(saved, "refusing")


def test_manifest_naming_a_file_outside_is_refused(saved: str, tmp_path) -> None:
    step_dir = os.path.join(saved, "step_1")
    shutil.copy(os.path.join(step_dir, "shared.pt"), tmp_path / "foreign.pt")
    manifest_path = os.path.join(step_dir, MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"]["../../foreign.pt"] = manifest["files"].pop("shared.pt")
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    _refused(saved, "lists a file '../../foreign.pt'")


def test_data_file_that_is_a_symlink_out_is_refused(saved: str, tmp_path) -> None:
    rank_file = os.path.join(saved, "step_1", "rank_0.pt")
    shutil.move(rank_file, tmp_path / "moved.pt")  # same bytes, so the sha256 still matches
    os.symlink(tmp_path / "moved.pt", rank_file)
    _refused(saved, "symbolic link")


def test_directories_an_interrupted_save_left_are_never_loaded(saved: str) -> None:
    for leftover in (".tmp_step_2", ".old_step_1"):
        shutil.copytree(os.path.join(saved, "step_1"), os.path.join(saved, leftover))  # complete copies
        _refused(os.path.join(saved, leftover), "not a published checkpoint")


# --------------------------------------------------------------------------- weights_only


def test_extra_of_plain_data_round_trips(tmp_path) -> None:
    model, optimizer = cases.build(2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    cases.train(model, optimizer, 1)
    scheduler.step()
    extra = {"step": 3, "loss": 1.25, "name": "run-1", "flags": [True, None, 2.5e-3],
             "nested": {"counts": (1, 2, 3), 7: {"mask": torch.tensor([1, 0, 1])}},
             "scheduler": scheduler.state_dict()}
    cases.save_checkpoint(str(tmp_path), model, optimizer, extra=extra)
    shared = torch.load(tmp_path / "step_3" / "shared.pt", weights_only=True)  # no objects inside
    assert cases.same(shared["extra"], extra)
    model, optimizer = cases.build(2)
    assert cases.same(load_checkpoint(str(tmp_path), model, optimizer), extra)


def save_unstorable_extra(stage: int, ckpt_dir: str) -> dict:
    """Pool worker: an extra holding a Fraction (picklable, but not plain data)."""
    model, optimizer = cases.build(stage)
    try:
        cases.save_checkpoint(ckpt_dir, model, optimizer, extra={"step": 5, "sched": {"ratio": Fraction(1, 3)}})
    except CheckpointError as error:
        return {"error": str(error)}
    return {"error": None}


def test_extra_that_is_not_plain_data_is_refused_on_every_rank(rank_pools: RankPoolRegistry,
                                                               tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    pool = rank_pools.get(2)
    pool.run(cases.train_and_save, 1, ckpt, 1)
    for result in pool.run(save_unstorable_extra, 1, ckpt):
        assert result["error"] is not None, "an object in extra was saved"
        assert "extra['sched']['ratio'] is a fractions.Fraction" in result["error"], result["error"]
        assert "plain data only" in result["error"]
    assert sorted(os.listdir(ckpt)) == ["latest", "step_1"]  # nothing was written


class Tripwire:
    """Unpickling this runs ``__setstate__``: the code execution weights_only prevents."""

    marker = ""

    def __setstate__(self, state: dict) -> None:
        with open(state["marker"], "w") as f:
            f.write("code from the checkpoint ran")


def test_a_file_holding_a_pickled_object_is_refused_without_running_it(saved: str, tmp_path) -> None:
    step_dir = os.path.join(saved, "step_1")
    shared_path = os.path.join(step_dir, "shared.pt")
    shared = torch.load(shared_path, weights_only=True)
    trap = Tripwire()
    trap.marker = str(tmp_path / "ran")
    shared["extra"] = {"step": 1, "trap": trap}
    torch.save(shared, shared_path)
    manifest_path = os.path.join(step_dir, MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    with open(shared_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    manifest["files"]["shared.pt"] = {"bytes": os.path.getsize(shared_path), "sha256": digest}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    _refused(saved, "shared.pt: cannot be read (Weights only load failed")
    assert not os.path.exists(tmp_path / "ran")


# --------------------------------------------------------------------------- leftovers


def test_leftovers_of_a_crashed_save_are_removed_by_the_next_save(saved: str) -> None:
    for name in (".tmp_step_9", ".old_step_4", "step_4.previous"):
        os.makedirs(os.path.join(saved, name))
        with open(os.path.join(saved, name, "rank_0.pt"), "wb") as f:
            f.write(b"half a file")
    with open(os.path.join(saved, "latest.tmp"), "w") as f:
        f.write("step_9\n")
    cases.train_and_save(1, saved, 2)
    assert sorted(os.listdir(saved)) == ["latest", "step_1", "step_2"]


def test_latest_naming_the_held_copy_loads_and_the_next_save_removes_it(saved: str) -> None:
    """The state a crash leaves while step_1 is being saved again: latest -> step_1.previous."""
    os.rename(os.path.join(saved, "step_1"), os.path.join(saved, "step_1.previous"))
    _point_latest(saved, "step_1.previous")
    model, optimizer = cases.build(1)
    assert load_checkpoint(saved, model, optimizer) == {"step": 1}
    cases.train_and_save(1, saved, 1)  # the re-save completes this time
    assert sorted(os.listdir(saved)) == ["latest", "step_1"]
    assert latest_checkpoint(saved).endswith("step_1")


def _mount_namespace_available() -> bool:
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


def test_full_disk_and_file_size_limit_name_the_os_error(tmp_path) -> None:
    """ENOSPC on a 4 MiB tmpfs (a faked write where no mount namespace is allowed), then EFBIG."""
    script = os.path.join(HERE, "save_error_cases.py")
    command = [sys.executable, script, str(tmp_path)]
    if _mount_namespace_available():
        command = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=4m tmpfs "$1" && shift && exec "$@"',
                   "sh", str(tmp_path)] + command
    else:
        command.append("--fake-enospc")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": scripts_pythonpath()}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    enospc, efbig = results["enospc"], results["efbig"]
    assert enospc["first"]["error"] is None
    assert "No space left on device" in enospc["full"]["error"], enospc["full"]["error"]
    assert "inline_container" not in enospc["full"]["error"]
    assert enospc["full"]["latest"] == "step_1"
    assert enospc["full"]["entries"] == ["latest", "step_1"], "the failed save left files behind"
    assert enospc["after"] == {"error": None, "latest": "step_3", "entries": ["latest", "step_1", "step_3"]}
    assert "File too large" in efbig["error"] and "rank_0.pt" in efbig["error"], efbig["error"]
    assert "inline_container" not in efbig["error"]
    assert efbig["entries"] == [], "the failed save left files behind"
