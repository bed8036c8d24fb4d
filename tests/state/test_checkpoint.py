"""Checkpoints: exact resume, atomic publishing, corruption, consolidation, full state on rank 0.

Rank workers live in ``checkpoint_cases.py``. Resharding (save at N ranks and
stage s, load at M and t) is the property test in ``test_checkpoint_resharding.py``;
dead and hanging ranks are in ``test_checkpoint_failures.py``.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import checkpoint_cases as cases
from rank_pool import RankPoolRegistry
from shardengine.state.checkpoint import LATEST, MANIFEST, latest_checkpoint
from shardengine.state.checkpoint.index import LayoutIndex
from shardengine.state.consolidate import consolidate, consolidated_optimizer_state, main as consolidate_main
from toy_models import make_optimizer
from rank_pool import REPO_ROOT  # noqa: E402



pytestmark = pytest.mark.prestart(2, 3)  # start-ups overlap (conftest.py)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_exact_resume_is_bit_identical(rank_pools: RankPoolRegistry, stage: int, tmp_path) -> None:
    results = rank_pools.get(2).run(cases.exact_resume, stage, str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        assert result["identical"], f"rank {rank}: {result['differs']} differ after resuming"
        assert result["extra"] == {"step": 2, "note": "half way"}


def test_checkpoint_layout_on_disk(rank_pools: RankPoolRegistry, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    rank_pools.get(2).run(cases.train_and_save, 3, str(ckpt), 2)
    assert (ckpt / LATEST).read_text().strip() == "step_2"
    step_dir = ckpt / "step_2"
    assert sorted(os.listdir(step_dir)) == ["manifest.json", "rank_0.json", "rank_0.pt", "rank_1.json", "rank_1.pt",
                                            "shared.pt"]
    manifest = json.loads((step_dir / MANIFEST).read_text())
    assert (manifest["world_size"], manifest["stage"], manifest["rank_files"]) == (2, 3, 2)
    assert set(manifest["versions"]) >= {"torch", "shardengine"}
    assert list(manifest["files"]) == ["shared.pt"] and "index" not in manifest  # nothing per rank
    sidecars = {name: json.loads((step_dir / f"{name[:-3]}.json").read_text()) for name in ("rank_0.pt", "rank_1.pt")}
    for name, info in [("shared.pt", manifest["files"]["shared.pt"]), *sidecars.items()]:
        assert os.path.getsize(step_dir / name) == info["bytes"] and len(info["sha256"]) == 64
    tied = next(p for p in manifest["params"] if p["name"] == "embed.weight")
    assert tied["keys"] == ["embed.weight", "head.weight"]
    # Each rank wrote only its own fragments: together they cover every element once, and
    # where each one lies follows from the manifest's layout alone (index.py).
    covered = {p["name"]: 0 for p in manifest["params"]}
    located = LayoutIndex(manifest)
    for name, sidecar in sidecars.items():
        for param, start, end in sidecar["index"]:
            covered[param] += end - start
            assert (start, end, name) in located.pieces(param)
    assert covered == {p["name"]: int(torch.Size(p["shape"]).numel()) for p in manifest["params"]}


def _as_format_1(step_dir, into) -> None:
    """The checkpoint as format 1 wrote it: every rank's files and index in the manifest, no sidecars."""
    import shutil
    shutil.copytree(step_dir, into)
    manifest = json.loads((into / MANIFEST).read_text())
    sidecars = {f"rank_{r}.pt": json.loads((into / f"rank_{r}.json").read_text()) for r in range(manifest["rank_files"])}
    for r in range(manifest["rank_files"]):
        os.remove(into / f"rank_{r}.json")
    manifest["files"].update({name: {"bytes": s["bytes"], "sha256": s["sha256"]} for name, s in sidecars.items()})
    manifest["index"] = {name: s["index"] for name, s in sidecars.items() if s["index"]}
    manifest["format"] = "shardengine-universal/1"
    del manifest["rank_files"]
    (into / MANIFEST).write_text(json.dumps(manifest))


def test_a_format_1_checkpoint_still_reads(rank_pools: RankPoolRegistry, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    rank_pools.get(3).run(cases.train_and_save, 2, str(ckpt), 1)
    _as_format_1(ckpt / "step_1", tmp_path / "old")
    assert cases.same(consolidate(str(tmp_path / "old")), consolidate(str(ckpt)))
    old, new = consolidated_optimizer_state(str(tmp_path / "old")), consolidated_optimizer_state(str(ckpt))
    assert sorted(old) == sorted(new) and all(cases.same(old[k], new[k]) for k in new)


def test_keep_prunes_old_checkpoints(rank_pools: RankPoolRegistry, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    for steps in (1, 2, 3):
        rank_pools.get(2).run(cases.train_and_save, 1, str(ckpt), steps, 2)
    assert sorted(os.listdir(ckpt)) == ["latest", "step_2", "step_3"]
    assert latest_checkpoint(str(ckpt)) == str(ckpt / "step_3")


def test_failed_save_leaves_previous_checkpoint_loadable(rank_pools: RankPoolRegistry, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    pool = rank_pools.get(2)
    pool.run(cases.train_and_save, 2, ckpt, 1)
    results = pool.run(cases.save_with_fault, 2, ckpt, 1)
    for result in results:  # every rank raised, naming the failing rank and the cause
        assert "rank 1" in result["error"] and "disk full (injected)" in result["error"]
    assert latest_checkpoint(ckpt).endswith("step_1")
    assert sorted(os.listdir(ckpt)) == ["latest", "step_1"]  # the failed save removed its files
    loaded = pool.run(cases.load_resave_and_step, 2, ckpt, str(tmp_path / "again"), 0)
    assert loaded[0]["extra"] == {"step": 1}


# --------------------------------------------------------------------------- corruption


def _damage_truncate(step_dir: str) -> str:
    path = os.path.join(step_dir, "rank_1.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return "rank_1.pt: truncated"


def _damage_flip_byte(step_dir: str) -> str:
    path = os.path.join(step_dir, "rank_0.pt")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return "rank_0.pt: sha256 mismatch"


def _damage_remove(step_dir: str) -> str:
    os.remove(os.path.join(step_dir, "rank_1.pt"))
    return "rank_1.pt: missing"


def _damage_remove_sidecar(step_dir: str) -> str:
    os.remove(os.path.join(step_dir, "rank_0.json"))
    return "rank_0.json: missing"


def _damage_edit_sidecar(step_dir: str) -> str:
    path = os.path.join(step_dir, "rank_1.json")
    with open(path) as f:
        sidecar = json.load(f)
    sidecar["bytes"] -= 1
    with open(path, "w") as f:
        json.dump(sidecar, f)
    return "rank_1.pt: longer than recorded"


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip_byte, _damage_remove, _damage_remove_sidecar,
                                    _damage_edit_sidecar])
def test_damaged_checkpoint_is_refused_and_nothing_changes(rank_pools: RankPoolRegistry, tmp_path,
                                                           damage) -> None:
    ckpt = str(tmp_path / "ckpt")
    pool = rank_pools.get(2)
    pool.run(cases.train_and_save, 2, ckpt, 2)
    expected = damage(os.path.join(ckpt, "step_2"))
    for rank, result in enumerate(pool.run(cases.failed_load, 2, ckpt)):
        assert result["error"] is not None and expected in result["error"], (rank, result["error"])
        assert result["unchanged"], f"rank {rank}: the failed load changed the model or optimizer"


def test_checkpoint_of_another_model_is_refused(rank_pools: RankPoolRegistry, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    pool = rank_pools.get(2)
    pool.run(cases.train_and_save, 1, ckpt, 1)
    for result in pool.run(cases.failed_load, 3, ckpt, cases.DIM + 2):
        assert "different model layout" in result["error"] and MANIFEST in result["error"]
        assert "embed.weight has shape [11, 6] in the checkpoint, [11, 8] in the model" in result["error"]
        assert result["unchanged"]


# --------------------------------------------------------------------------- consolidation, full state


def test_consolidated_checkpoint_loads_into_the_unwrapped_model(rank_pools: RankPoolRegistry,
                                                                tmp_path, forked_python) -> None:
    ckpt = str(tmp_path / "ckpt")
    result = rank_pools.get(3).run(cases.train_and_save, 3, ckpt, 2)[0]
    saved = result["full"]
    out, opt_out = tmp_path / "model.pt", tmp_path / "optimizer.pt"
    done = subprocess.run([forked_python.python, "-m", "shardengine.consolidate", ckpt, str(out),
                           "--optimizer", str(opt_out)],
                          cwd=REPO_ROOT, env=forked_python.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    state = torch.load(out, weights_only=True)
    net = cases.make_net()
    assert list(state) == list(net.state_dict())  # same keys, same order, tied key included
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    net.load_state_dict(state)
    assert cases.same(saved, net.state_dict())
    assert cases.same(consolidate(ckpt), state)
    # The optimizer too, in torch's own format: what the engine's full_optimizer_state_dict()
    # gives, and a plain torch AdamW over the unwrapped model loads it.
    optimizer_state = torch.load(opt_out, weights_only=True)
    expected = result["full_optimizer"]
    assert optimizer_state["param_groups"] == expected["param_groups"]
    assert sorted(optimizer_state["state"]) == sorted(expected["state"])
    for position, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(optimizer_state["state"][position][key]), torch.as_tensor(value))
    plain = make_optimizer(net, **cases.OPTIMIZER)
    plain.load_state_dict(optimizer_state)
    assert plain.state[net.embed.weight]["exp_avg"].shape == net.embed.weight.shape


def test_consolidate_cli_reports_a_damaged_checkpoint(tmp_path, rank_pools: RankPoolRegistry,
                                                      capsys) -> None:
    ckpt = str(tmp_path / "ckpt")
    rank_pools.get(2).run(cases.train_and_save, 1, ckpt, 1)
    _damage_remove(os.path.join(ckpt, "step_1"))
    assert consolidate_main([ckpt, str(tmp_path / "o.pt")]) == 1
    assert "rank_1.pt: missing" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.pt")


@pytest.mark.parametrize("stage", [0, 3])
def test_full_state_dict_rank0_only(rank_pools: RankPoolRegistry, stage: int) -> None:
    results = rank_pools.get(3).run(cases.full_state_rank0_only, stage)
    assert [r["rank0"] == {} for r in results] == [False, True, True]
    reference = cases.make_net().state_dict()
    assert list(results[0]["rank0"]) == list(reference)
    assert cases.same(results[0]["rank0"], results[0]["all"])
    assert all(cases.same(r["all"], results[0]["all"]) for r in results)


def test_world_size_one_without_process_group(tmp_path) -> None:
    """No process group at all: save, load and consolidate still work (and resume exactly)."""
    result = cases.exact_resume(3, str(tmp_path / "ckpt"))
    assert result["identical"], result["differs"]
    states = consolidated_optimizer_state(str(tmp_path / "ckpt"))
    assert set(states["embed.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert states["embed.weight"]["exp_avg"].shape == (cases.VOCAB, cases.DIM)
    assert "blocks.0.bias" not in states  # frozen: values only


@pytest.mark.parametrize("stage,options", [
    (0, {"param_dtype": "bf16"}), (3, {"param_dtype": "bf16"}),
    (2, {"param_dtype": "fp16"}), (1, {"offload_optimizer": True}),
])
def test_exact_resume_with_fp32_masters(rank_pools: RankPoolRegistry, stage: int, options: dict,
                                        tmp_path) -> None:
    """Mixed precision and offload keep separate fp32 masters: those are what is saved and restored."""
    results = rank_pools.get(2).run(cases.exact_resume, stage, str(tmp_path / "ckpt"), **options)
    for rank, result in enumerate(results):
        assert result["identical"], f"rank {rank}: {result['differs']} differ after resuming"
    if options.get("param_dtype") == "fp16":
        assert [r["restored_scale"] for r in results] == [1024.0, 1024.0]
    manifest = json.loads((tmp_path / "ckpt" / "step_2" / MANIFEST).read_text())
    trained = next(p for p in manifest["params"] if p["name"] == "embed.weight")
    assert trained["dtype"] == "float32"  # the master's values, not the compute copy's
