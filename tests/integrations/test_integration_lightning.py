"""ShardStrategy under lightning.pytorch.Trainer, on 2 Gloo ranks (workers: lightning_cases.py)."""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("lightning")

import lightning_cases as cases  # noqa: E402
from engine_cases import rel_err  # noqa: E402

TOL = 2e-4
CALL_S = 600  # Trainer objects are heavy: a first call imports the trainer library on each rank


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fit_with_accumulation_and_clipping_equals_the_hand_written_loop(rank_pools, stage: int) -> None:
    results = rank_pools.get(2).run(cases.fit_equals_loop, stage, timeout=CALL_S)
    first = results[0]
    assert max(first["errors"].values()) <= TOL, first["errors"]
    assert first["moved"] > 1e-3, "training did not change the parameters: the comparison would be vacuous"
    assert first["global_step"] == 3
    assert math.isclose(first["lr"], cases.LR * cases.schedule(3)), "the LR scheduler did not follow the steps"
    # self.log(sync_dist=True) is reduced over ranks; validate() and predict() run through the engine
    assert results[1]["val_loss"] == first["val_loss"] and math.isfinite(first["val_loss"])
    assert all(len(p) == cases.BATCH for p in first["predictions"])


def test_bf16_mixed_precision_is_the_engines_param_dtype(rank_pools) -> None:
    first = rank_pools.get(2).run(cases.fit_equals_loop, 2, precision="bf16-mixed", timeout=CALL_S)[0]
    assert max(first["errors"].values()) <= TOL, first["errors"]
    assert first["moved"] > 1e-3


def test_resume_from_ckpt_path_continues_exactly_and_exports_one_file(rank_pools, tmp_path) -> None:
    same = rank_pools.get(2).run(cases.save_resume, 1, 1, str(tmp_path / "same"), timeout=CALL_S)[0]
    assert same["identical"], same["errors"]          # same world size and stage: bit-identical
    assert same["files"] == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert same["global_step"] == 4 and same["epoch"] == 2
    assert math.isclose(same["lr"], cases.LR * cases.schedule(4))

    other_stage = rank_pools.get(2).run(cases.save_resume, 2, 3, str(tmp_path / "other"), timeout=CALL_S)[0]
    assert max(other_stage["errors"].values()) <= TOL, other_stage["errors"]

    # another world size: the 2-rank checkpoint on 1 rank (per-rank batch doubled: same global batches)
    ckpt = str(tmp_path / "same" / "ckpts" / "epoch=0.ckpt")
    one = rank_pools.get(1).run(cases.resume_at_other_world, str(tmp_path / "one"), ckpt, timeout=CALL_S)[0]
    assert one["global_step"] == 4
    errors = {k: rel_err(one["state"][k], same["final"][k]) for k in same["final"]}
    assert max(errors.values()) <= TOL, errors

    # the consolidated export loads with LightningModule.load_from_checkpoint, no process group
    exported = cases.export_and_reload(str(tmp_path / "same" / "ckpts" / "epoch=1.ckpt"), str(tmp_path / "m.ckpt"))
    assert sorted(exported) == sorted(same["final"])
    assert all(exported[k].equal(same["final"][k]) for k in exported)
    # ... and, as a one-file checkpoint, loads back into a sharded model through ckpt_path=
    # ... and, as a one-file checkpoint, loads back into a sharded model through ckpt_path=; a sharded
    # directory loads into a trainer that only validates
    loaded = rank_pools.get(2).run(cases.load_one_file, str(tmp_path / "again"), str(tmp_path / "m.ckpt"),
                                   str(tmp_path / "same" / "ckpts" / "epoch=1.ckpt"), timeout=CALL_S)
    assert loaded[0]["global_step"] == 4
    assert all(loaded[0]["state"][k].equal(same["final"][k]) for k in same["final"])
    for result in loaded:
        assert all(result["validated"][k].equal(same["final"][k]) for k in same["final"])


def test_unsupported_combinations_are_clear_errors(rank_pools, tmp_path) -> None:
    for found in rank_pools.get(2).run(cases.bad_combinations, str(tmp_path), timeout=CALL_S):
        assert "unknown option(s) ['bucket_size']" in found["option"]
        assert "stage must be one of" in found["stage"]
        assert "does not support precision='bf16-true'" in found["precision"]
        assert "set one of them" in found["dtype_conflict"]
        assert "gradient_clip_algorithm='norm'" in found["clip_value"]
        assert "shards one optimizer; configure_optimizers returned 2" in found["two_optimizers"]


def test_consolidate_command_line(tmp_path, rank_pools) -> None:
    """``python -m shardengine.integrations.lightning.consolidate`` writes the same file."""
    rank_pools.get(2).run(cases.save_resume, 0, 0, str(tmp_path), timeout=CALL_S)
    from shardengine.integrations.lightning.consolidate import main
    out = str(tmp_path / "cli.ckpt")
    assert main([str(tmp_path / "ckpts" / "epoch=1.ckpt"), out]) == 0
    assert os.path.getsize(out) > 0
    assert sorted(cases.LitLM.load_from_checkpoint(out).state_dict()) == sorted(cases.LitLM().state_dict())
