"""ShardTrainer, a transformers.Trainer on shardengine, on 2 Gloo ranks (workers: hf_trainer_cases.py)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

import hf_trainer_cases as cases  # noqa: E402
from engine_cases import rel_err  # noqa: E402
from hf_cases import load  # noqa: E402

TOL = 2e-4
CALL_S = 600  # Trainer objects are heavy: a first call imports the trainer library on each rank


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_with_accumulation_and_clipping_equals_the_hand_written_loop(rank_pools, tmp_path, stage: int) -> None:
    results = rank_pools.get(2).run(cases.train_equals_loop, stage, str(tmp_path), timeout=CALL_S)
    first = results[0]
    for result in results:
        assert max(result["errors"].values()) <= TOL, result["errors"]
    assert first["steps"] == 3
    assert results[1]["eval_loss"] == first["eval_loss"]
    assert first["logits_shape"] == (4, cases.SEQ, cases.VOCAB)   # predict() gathers both ranks' rows
    # save_model wrote an ordinary folder: from_pretrained gives the trained weights
    reloaded = load("llama", str(tmp_path / "final")).state_dict()
    initial = cases.build("llama").state_dict()
    assert max(rel_err(first["state"][k], initial[k]) for k in initial) > 1e-3, "training changed nothing"
    errors = {k: rel_err(reloaded[k], first["state"][k]) for k in first["state"]}
    assert max(errors.values()) == 0.0, errors


@pytest.mark.parametrize("stage,resume_stage", [(1, 1), (2, 3)])
def test_resume_from_checkpoint_continues_exactly(rank_pools, tmp_path, stage: int, resume_stage: int) -> None:
    first = rank_pools.get(2).run(cases.save_resume, stage, resume_stage, str(tmp_path), timeout=CALL_S)[0]
    assert first["step"] == 4
    assert "shardengine" in first["files"] and "model.safetensors" in first["files"]
    if stage == resume_stage:
        assert first["identical"], first["errors"]
    assert max(first["errors"].values()) <= TOL, first["errors"]


def test_resume_at_another_world_size(rank_pools, tmp_path) -> None:
    saved = rank_pools.get(2).run(cases.save_resume, 2, 2, str(tmp_path / "two"), timeout=CALL_S)[0]
    one = rank_pools.get(1).run(cases.resume_at_other_world, str(tmp_path / "two" / "checkpoint-2"),
                                str(tmp_path / "one"), timeout=CALL_S)[0]
    assert one["step"] == 4
    errors = {k: rel_err(one["state"][k], saved["final"][k]) for k in saved["final"]}
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("stage", [1, 3])
def test_peft_model_saves_only_the_adapter(rank_pools, tmp_path, stage: int) -> None:
    first = rank_pools.get(2).run(cases.peft_adapter_only, stage, str(tmp_path), timeout=CALL_S)[0]
    assert "adapter_model.safetensors" in first["files"] and "adapter_config.json" in first["files"]
    assert not any(name.startswith("model") for name in first["files"]), first["files"]
    assert max(first["errors"].values()) == 0.0, first["errors"]
    assert first["moved"] > 1e-3


def test_unsupported_combinations_are_clear_errors(rank_pools, tmp_path) -> None:
    for found in rank_pools.get(2).run(cases.bad_combinations, str(tmp_path), timeout=CALL_S):
        assert "deepspeed= is set: ShardTrainer replaces DeepSpeed" in found["deepspeed"]
        assert "fsdp= is set: ShardTrainer replaces FSDP" in found["fsdp"]
        assert "torch_compile=True is not supported" in found["torch_compile"]
        assert "unknown option(s) ['bucket_size']" in found["option"]
        assert "stage must be one of" in found["stage"]
        assert "bf16=True) asks for bf16 compute" in found["dtype_conflict"]
        assert "shard_config must be a shardengine.config.ShardConfig" in found["shard_config_type"]
        assert "Adafactor is not known to be element-wise" in found["adafactor"]


def test_load_best_model_at_end_loads_the_best_checkpoint_into_the_sharded_model(rank_pools, tmp_path) -> None:
    results = rank_pools.get(2).run(cases.best_model_at_end, str(tmp_path), 3, timeout=CALL_S)
    best = results[0]["best"]
    assert best is not None and not best.endswith("checkpoint-3"), best   # the highest eval loss: an early step
    want = load("llama", best).state_dict()
    for result in results:
        assert result["best"] == best
        errors = {k: rel_err(result["state"][k], want[k]) for k in want}
        assert max(errors.values()) == 0.0, errors
