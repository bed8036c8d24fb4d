"""``--emit``: each offload tier written as the engine's own offload, the configuration the
engine's memory model prices, and a clear refusal where the engine has no such offload.

- ``zero3-offload-params``: DeepSpeed's ``offload_param`` beside ``offload_optimizer`` (both
  ``cpu``), FSDP2's ``CPUOffloadPolicy``, shard()'s ``offload_params=True``;
- the disk plans: DeepSpeed's NVMe tier (``device: "nvme"``) with a placeholder ``nvme_path``
  the note tells the user to edit; FSDP2 has none;
- optimizer-only offload: DeepSpeed's ``offload_optimizer`` alone; FSDP2 has none;
- fractional offload: shardengine's only.
"""
from __future__ import annotations

import json

import pytest

from memory_estimator import estimate
from memory_estimator.cli.command import main
from memory_estimator.cli.emit import NVME_PATH, emit_config, emit_note
from memory_estimator.errors import EstimatorInputError
from memory_estimator.plan.fastest import PlannedRun
from test_estimator_cli import LLAMA_7B

CPU = {"device": "cpu", "pin_memory": True}
NVME = {"device": "nvme", "nvme_path": NVME_PATH, "pin_memory": True}


def _run(plan: str, stage: int = 3, group: int = 8) -> PlannedRun:
    return PlannedRun(plan, stage, "offload" in plan, group, "full", 2, 4, 1.0, 1e4, 2**35)


def _zero(plan: str) -> dict:
    return emit_config("deepspeed", _run(plan), None, precision="bf16")["zero_optimization"]


def _priced_by_deepspeed(plan: str, config: dict):
    """The plan as DeepSpeed's model prices it under the emitted config's knobs."""
    return estimate(params=7e9, world_size=8, engine="deepspeed", deepspeed_config=config, disk=True,
                    device_memory_bytes=10**13, micro_batch=1, seq_len=64).plan(plan)


def test_parameter_offload_is_each_engines_parameter_offload():
    config = emit_config("deepspeed", _run("zero3-offload-params"), None, precision="bf16")
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": CPU, "offload_param": CPU}
    modelled = _priced_by_deepspeed("zero3-offload-params", config)  # what offload_param moves, it models
    assert (modelled.params, modelled.grads, modelled.optimizer_states) == (0, 0, 0)
    assert modelled.host_params == 2 * -(-7 * 10**9 // 8)
    fsdp2 = emit_config("fsdp2", _run("zero3-offload-params"), None, precision="bf16")
    assert fsdp2.count("offload_policy=CPUOffloadPolicy(pin_memory=True)") == 2  # every block and the root
    assert "offload_params=True" in emit_config("shardengine", _run("zero3-offload-params"), None, precision="bf16")


def test_optimizer_only_offload_is_not_written_as_fsdp2s_cpu_offload():
    assert _zero("zero3-offload") == {"stage": 3, "offload_optimizer": CPU}
    assert "offload_param" not in emit_config("deepspeed", _run("zero2-offload", 2), None)["zero_optimization"]
    with pytest.raises(EstimatorInputError, match="offloads only the optimizer; FSDP2 has no such offload"):
        emit_config("fsdp2", _run("zero3-offload"), None, precision="bf16")


@pytest.mark.parametrize("plan, sections", [("zero3-offload-disk", {"offload_optimizer": NVME}),
                                            ("zero3-offload-params-disk",
                                             {"offload_optimizer": NVME, "offload_param": NVME})])
def test_disk_plans_are_deepspeeds_nvme_offload_with_a_path_to_edit(plan, sections):
    config = emit_config("deepspeed", _run(plan), None, precision="bf16")
    assert config["zero_optimization"] == {"stage": 3, **sections}
    modelled = _priced_by_deepspeed(plan, config)
    assert modelled.disk_bytes > 0 and modelled.optimizer_states == 0
    note = emit_note("deepspeed", _run(plan), "deepspeed")
    assert f"edit nvme_path (now {NVME_PATH!r})" in note
    assert ("max_in_cpu" in note) == ("offload_param" in sections)
    assert "edit offload_path" in emit_note("shardengine", _run(plan), "shardengine")


@pytest.mark.parametrize("plan", ["zero3-offload-params-0.5", "zero3-offload-params-budget-1024B"])
@pytest.mark.parametrize("kind", ["deepspeed", "fsdp2"])
def test_fractional_offload_is_shardengines_alone(plan, kind):
    with pytest.raises(EstimatorInputError, match="moves all of a rank's parameters or none. Use --emit "
                                                  f"shardengine, or plan .* with --engine {kind}"):
        emit_config(kind, _run(plan), None, precision="bf16")


def test_deepspeed_shards_within_groups_at_stage_3_only():
    assert _zero("zero3-hsdp8")["mics_shard_size"] == 8
    with pytest.raises(EstimatorInputError, match="DeepSpeed does so only at stage 3"):
        emit_config("deepspeed", _run("zero2-hsdp8", 2), None, precision="bf16")


def test_the_note_says_when_another_engines_model_priced_the_plan(capsys):
    """``--emit deepspeed`` under ``--engine shardengine``: the plan's bytes are shardengine's."""
    argv = ["--config", LLAMA_7B, "--gpus", "8", "--seq-len", "4096", "--checkpointing", "full",
            "--objective", "fastest", "--json", "--emit", "deepspeed"]
    assert main(argv) == 0
    note = json.loads(capsys.readouterr().out)["emit"]["note"]
    assert "priced with shardengine's memory model; --engine deepspeed" in note
    assert main(argv + ["--engine", "deepspeed"]) == 0
    assert "note" not in json.loads(capsys.readouterr().out)["emit"]
