"""The disk-tier plans in the estimator, planned on request (``disk=True``, ``--offload disk``):
shardengine's ``zero3-offload-disk`` (``Offload(optimizer="disk")``) and ``zero3-offload-params-disk``
(``Offload(params="disk")``), and DeepSpeed's NVMe offload under the same names. Each keeps on the device what its host-memory counterpart keeps and moves that
plan's host bytes into files, the gradients excepted (they wait for the step on the host); the
analytic formulas and the exact plan of a module agree on them. Byte-for-byte agreement with
``memory_report()`` is in test_estimator_engine_agreement.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn

from memory_estimator import estimate
from memory_estimator.cli.command import main
from memory_estimator.cli.emit import emit_config
from memory_estimator.engines import DeepSpeedKnobs, ShardEngine, make_engine
from memory_estimator.errors import EstimatorInputError
from memory_estimator.plan.fastest import PlannedRun, with_fractions
from memory_estimator.plan.memory import plan_estimate
from memory_estimator.terms.model_states import plan_spec
from test_estimator_cli import LLAMA_7B, run_json

PAIRS = (("zero3-offload", "zero3-offload-disk"), ("zero3-offload-params", "zero3-offload-params-disk"))
DEVICE_TERMS = ("params", "grads", "optimizer_states", "activations", "working_set", "overhead", "total")


def _module() -> nn.Module:
    """Four units whose sizes divide by 2 ranks: no padding, so the formulas are exact too."""
    return nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)])


@pytest.mark.parametrize("source", ["count", "module"])
def test_disk_plans_move_the_host_bytes_into_files(source):
    model = {"params": 7e9} if source == "count" else {"module": _module()}
    result = estimate(**model, world_size=8, precision="bf16", optimizer="adamw", disk=True,
                      device_memory_bytes=10**13, micro_batch=1, seq_len=64)
    for host_name, disk_name in PAIRS:
        host, disk = result.plan(host_name), result.plan(disk_name)
        assert [getattr(disk, t) for t in DEVICE_TERMS] == [getattr(host, t) for t in DEVICE_TERMS]
        assert disk.host_bytes == host.host_grads  # only the reduced gradients stay in host memory
        assert disk.disk_bytes == host.host_params + host.host_optimizer_states > 0
        assert disk.disk_params == host.host_params
    assert result.recommended not in {name for _, name in PAIRS}  # same device bytes, later in the order


def test_analytic_and_exact_models_agree_on_the_disk_plans():
    result = estimate(module=_module(), world_size=2, precision="bf16", optimizer="adamw", disk=True,
                      device_memory_bytes=10**12, micro_batch=1, seq_len=8)
    analytic = replace(result.memory_inputs.analytic(), engine=ShardEngine(disk=True))
    fields = ("params", "grads", "optimizer_states", "host_bytes", "disk_bytes", "disk_params")
    for _, name in PAIRS:
        exact, formula = result.plan(name), plan_estimate(plan_spec(name), analytic)
        assert [getattr(exact, f) for f in fields] == [getattr(formula, f) for f in fields], name


def test_the_planner_searches_the_disk_plans_beside_its_fractions():
    """``--objective fastest`` adds its fractional plans to the model of shardengine; the disk
    tier's plans, asked for, stay among those it searches."""
    result = estimate(module=_module(), world_size=2, precision="bf16", optimizer="adamw", disk=True,
                      device_memory_bytes=10**12, micro_batch=1, seq_len=8)
    names = [plan.name for plan in with_fractions(result.memory_inputs).engine.plans]
    assert {name for _, name in PAIRS} | {"zero3-offload-params-0.25", "zero3-offload-params-0.75"} <= set(names)


def test_disk_plans_are_planned_only_when_asked_for():
    assert not any(plan.disk for plan in make_engine("shardengine").plans)
    assert [p.name for p in make_engine("shardengine", disk=True).plans if p.disk] == [n for _, n in PAIRS]
    assert [p.name for p in make_engine("deepspeed", disk=True).plans if p.disk] == [n for _, n in PAIRS]
    assert not any(plan.disk for plan in make_engine("deepspeed").plans)
    for engine in ("fsdp2", "ddp"):
        with pytest.raises(EstimatorInputError, match="drop --offload disk"):
            make_engine(engine, disk=True)


def test_cli_offload_disk_lists_and_prices_the_disk_plans(capsys):
    code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--offload", "disk")
    assert code == 0
    plans = {plan["name"]: plan for plan in payload["plans"]}
    for host, disk in PAIRS:
        assert plans[disk]["per_rank_bytes"] == plans[host]["per_rank_bytes"]
        assert plans[disk]["disk_bytes"] > 0 and plans[disk]["host_bytes"] < plans[host]["host_bytes"]
    code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--offload", "disk",
                             "--interconnect", "ib-ndr", "--nodes", "1", "--gpus-per-node", "8")
    assert code == 0
    times = {plan["name"]: plan for plan in payload["plans"]}
    step = {name: plan["time"]["step_time_s"] for name, plan in times.items()}
    assert step["zero3-offload-params-disk"] > step["zero3-offload-params"]
    assert step["zero3-offload-disk"] > step["zero3-offload"]
    assert main(["--config", LLAMA_7B, "--engine", "fsdp2", "--offload", "disk"]) == 2
    assert "drop --offload disk" in capsys.readouterr().err


@pytest.mark.parametrize("plan, options", [
    ("zero3-offload-params-disk", 'offload_params="disk", offload_path='),
    ("zero3-offload-disk", 'offload_optimizer="disk", offload_path='),
])
def test_a_disk_plan_is_emitted_as_the_disk_tier_and_refused_by_fsdp2(plan, options):
    """``--emit``: a disk plan is shard()'s disk tier (not taken for a fractional plan by its
    name); FSDP2 has no disk tier and says what to do instead (DeepSpeed's NVMe tier:
    test_estimator_emit.py)."""
    run = PlannedRun(plan, 3, True, None, "full", 2, 4, 1.0, 1e4, 2**35)
    assert options in emit_config("shardengine", run, None, precision="bf16")
    with pytest.raises(EstimatorInputError, match="FSDP2 has no disk tier.*Use --emit shardengine"):
        emit_config("fsdp2", run, None, precision="bf16")


def _deepspeed(**knobs):
    return estimate(params=7e9, world_size=8, engine="deepspeed", precision="bf16", optimizer="adamw", disk=True,
                    device_memory_bytes=10**13, micro_batch=1, seq_len=64, **knobs)


def test_deepspeeds_nvme_plans_keep_the_device_bytes_and_swap_what_its_cpu_offload_holds():
    """ZeRO-Infinity's NVMe tier ([Note: DeepSpeed's NVMe tier]): the device holds what the ``cpu``
    plan holds; the fp32 master, Adam's state and the fp32 gradient partitions go to files; host
    memory keeps ``buffer_count`` (4) swap buffers and a gradient buffer of a sub-group (the shard,
    under the default ``sub_group_size`` of 1e9), and up to ``max_in_cpu`` (1e9) parameter elements
    beside ``offload_param``'s 5 x 1e8-element swap buffers."""
    result, shard = _deepspeed(), -(-7 * 10**9 // 8)
    for host_name, disk_name in PAIRS:
        host, disk = result.plan(host_name), result.plan(disk_name)
        assert [getattr(disk, t) for t in DEVICE_TERMS] == [getattr(host, t) for t in DEVICE_TERMS]
        assert disk.disk_bytes - disk.disk_params == (4 + 8 + 4) * shard
    assert result.plan("zero3-offload-disk").host_bytes == (4 * 4 + 4) * shard
    params_disk = result.plan("zero3-offload-params-disk")
    assert params_disk.disk_params == 0 and params_disk.host_params == 2 * shard  # shard < max_in_cpu
    assert params_disk.host_bytes == (4 * 4 + 4) * shard + 2 * shard + 2 * 5 * 10**8


def test_deepspeeds_nvme_knobs_come_from_its_config():
    config = {"zero_optimization": {"stage": 3, "sub_group_size": 10**8,
                                    "offload_optimizer": {"device": "nvme", "buffer_count": 6},
                                    "offload_param": {"device": "nvme", "max_in_cpu": 0, "buffer_count": 2,
                                                      "buffer_size": 10**7}}}
    plan, shard = _deepspeed(deepspeed_config=config).plan("zero3-offload-params-disk"), -(-7 * 10**9 // 8)
    assert plan.disk_params == 2 * shard and plan.host_params == 0
    assert plan.host_bytes == (6 * 4 + 4) * 10**8 + 2 * 2 * 10**7
    with pytest.raises(EstimatorInputError, match="offload_param must be an object"):
        DeepSpeedKnobs.from_config({"zero_optimization": {"offload_param": "nvme"}})


def test_a_deepspeed_sub_group_under_a_mebibyte_is_not_swapped():
    """DeepSpeed swaps only tensors of at least ``MIN_AIO_BYTES``; a smaller sub-group's optimizer
    stays in host memory, as with ``device: "cpu"``."""
    result = estimate(params=10**6, world_size=8, engine="deepspeed", precision="bf16", disk=True,
                      device_memory_bytes=10**13, micro_batch=1, seq_len=64)
    assert result.plan("zero3-offload-disk").disk_bytes == 0
    assert result.plan("zero3-offload-disk").host_bytes == result.plan("zero3-offload").host_bytes
