"""The fastest-plan planner, ``--emit``, and the time model's fine-tuning terms.

With ``--objective fastest`` the recommended plan and the largest
micro-batch in the text and the JSON refer to the same plan. The planner searches
checkpointing x micro-batch/accumulation x plans; ``--emit`` writes the choice as the
engine's configuration. Time: recompute FLOPs per checkpointing policy, a frozen base's
backward, Muon's Newton-Schulz spread over owners, a compute rate for every catalog
device (the throughput field set: tests/field/test_field_time.py).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from memory_estimator import estimate
from memory_estimator.cli.command import main
from memory_estimator.hardware.devices import CATALOG
from memory_estimator.hardware.rates import device_rates
from memory_estimator.plan.search import POLICIES
from memory_estimator.terms.model_states import plan_spec
from memory_estimator.timing.step import (Cluster, TimedPlan, Workload, backward_flops, forward_flops, optimizer_seconds,
                                     recompute_flops)
from memory_estimator.hardware.interconnects import resolve_link

LLAMA = str(Path(__file__).resolve().parents[1] / "configs" / "llama-2-7b.json")
FASTEST = ["--config", LLAMA, "--gpus", "8", "--micro-batch", "4", "--seq-len", "4096", "--checkpointing", "full",
           "--objective", "fastest"]


def test_fastest_objective_recommends_one_plan_in_text_and_json(capsys):
    assert main(FASTEST + ["--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    name, largest = payload["recommended"], payload["max_micro_batch"]
    plan = plan_spec(name)
    fits = lambda b: estimate(config=LLAMA, world_size=8, micro_batch=b, seq_len=4096,  # noqa: E731
                              checkpointing="full").plan(plan.name).fits
    assert fits(largest) and not fits(largest + 1)
    assert main(FASTEST) == 0
    text = capsys.readouterr().out
    assert f"recommended: {name}   largest micro-batch that fits it: {largest}" in text
    assert f"objective fastest: recommended {name}" in text


def test_planner_searches_checkpointing_and_accumulation_and_emits_configs(capsys):
    assert main(FASTEST + ["--grad-accum", "2", "--json", "--emit", "deepspeed"]) == 0
    payload = json.loads(capsys.readouterr().out)
    planned = payload["planned"]
    assert planned["micro_batch"] * planned["grad_accum"] == 8
    assert planned["checkpointing"] in POLICIES
    config = payload["emit"]["config"]
    assert config["train_micro_batch_size_per_gpu"] == planned["micro_batch"]
    assert config["gradient_accumulation_steps"] == planned["grad_accum"]
    assert config["zero_optimization"]["stage"] == planned["stage"] and config["bf16"] == {"enabled": True}
    assert main(FASTEST + ["--emit", "shardengine"]) == 0
    assert f"se.shard(model, optimizer, stage=" in capsys.readouterr().out
    assert main(FASTEST + ["--emit", "fsdp2"]) == 0
    assert "fully_shard(" in capsys.readouterr().out


def test_emit_without_the_fastest_objective_is_bad_input(capsys):
    assert main(["--config", LLAMA, "--gpus", "8", "--emit", "deepspeed"]) == 2
    assert "--objective fastest" in capsys.readouterr().err


def test_json_carries_each_plans_drivers(capsys):
    assert main(["--config", LLAMA, "--gpus", "8", "--seq-len", "4096", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    drivers = {d["flag"] for plan in payload["plans"] for d in plan["drivers"]}
    assert {"--checkpointing full", "--loss fused"} <= drivers


def test_every_catalog_device_has_a_compute_rate():
    for name in CATALOG:
        rates = device_rates(name)
        assert rates.peak_flops("bf16") > 0 and rates.peak_flops("fp32") > 0 and rates.memory_bytes_per_s > 0


def _workload(**changes) -> Workload:
    base = Workload(params=7 * 10**9, tokens_per_micro_step=4096, layers=32, hidden=4096, seq_len=4096)
    return replace(base, **changes)


def test_recompute_flops_follow_each_checkpointing_policy():
    forward = forward_flops(_workload())
    costs = {p: recompute_flops(_workload(checkpointing=p))
             for p in ("none", "selective:mm", "selective:op", "selective", "every-k:2", "full")}
    assert costs["none"] == costs["selective:mm"] == 0
    assert costs["selective:op"] == pytest.approx(7e9 * 4096)           # every other matmul: half of 2Ψt
    assert costs["every-k:2"] == pytest.approx(forward / 2) and costs["full"] == forward
    assert 0 < costs["selective"] < costs["full"]


def test_a_frozen_base_backward_computes_input_gradients_and_the_adapters_weight_gradients():
    full, lora = _workload(), _workload(trainable=20 * 10**6)
    assert backward_flops(full) == 2 * forward_flops(full)
    assert backward_flops(lora) == forward_flops(lora) + 2 * 20e6 * 4096


def test_newton_schulz_runs_everywhere_at_stage_0_and_on_owners_above():
    cluster = Cluster(1, 8, resolve_link("nvlink4"), resolve_link("ib-ndr"), device_rates("H100-80GB"))
    muon = _workload(optimizer="muon", newton_schulz_flops=1e15, precision="fp32")
    plain = _workload(optimizer="muon", precision="fp32")
    extra = {stage: optimizer_seconds(muon, TimedPlan("p", stage), cluster)
             - optimizer_seconds(plain, TimedPlan("p", stage), cluster) for stage in (0, 1, 3)}
    assert extra[0] == pytest.approx(8 * extra[1]) and extra[1] == pytest.approx(extra[3])


def test_a_tighter_device_picks_a_larger_fraction_of_the_parameters_on_the_host(capsys):
    """shardengine's fractional offload plans: the planner keeps as much resident as the memory
    allows, so less memory moves more to the host; --emit writes the fraction as shard() takes it."""
    picks = {}
    for memory in ("40GiB", "17GiB", "12GiB"):
        assert main(["--params", "7e9", "--hidden", "4096", "--layers", "32", "--heads", "32", "--vocab", "32000",
                     "--gpus", "8", "--micro-batch", "1", "--seq-len", "2048", "--checkpointing", "full", "--device", "H100-80GB",
                     "--gpu-memory", memory, "--objective", "fastest", "--json", "--emit", "shardengine"]) == 0
        payload = json.loads(capsys.readouterr().out)
        picks[memory] = plan_spec(payload["planned"]["plan"])
        if picks[memory].partial_params:
            assert f"offload_params={picks[memory].params_fraction:g}" in payload["emit"]["config"]
    shares = [0.0 if not p.partial_params else p.params_fraction for p in picks.values()]
    # (in between, offloading activations may keep every parameter resident: the planner's other lever)
    assert shares[0] == 0.0 and shares[0] <= shares[1] < shares[2] < 1, picks


HYBRID_STAGES = {"ddp": set(), "fsdp2": {2, 3}, "deepspeed": {3}, "shardengine": {1, 2, 3}}


@pytest.mark.parametrize("engine", sorted(HYBRID_STAGES))
def test_each_engine_is_offered_only_the_plans_it_runs(engine, capsys):
    """Across nodes, hybrid sharding is planned at the stages the engine shards within groups
    (DDP none; DeepSpeed's MiCS stage 3; FSDP2's 2-D mesh stages 2-3), so neither the
    recommended line nor the planner names a plan the engine cannot run."""
    assert main(["--config", LLAMA, "--engine", engine, "--nodes", "4", "--gpus-per-node", "8", "--seq-len", "4096",
                 "--checkpointing", "full", "--device", "H100-80GB", "--gpu-memory", "24GiB",
                 "--objective", "fastest", "--json"]) in (0, 1)
    payload = json.loads(capsys.readouterr().out)
    names = [plan["name"] for plan in payload["plans"]]
    assert {int(name[4]) for name in names if "-hsdp" in name} == HYBRID_STAGES[engine]
    runnable = set(names)
    assert payload["recommended"] in runnable | {None}
    assert payload.get("planned", {}).get("plan") in {None} | runnable | {
        f"zero{stage}-hsdp{k}" for stage in HYBRID_STAGES[engine] for k in (8, 16)}


def test_the_recommended_line_chooses_among_the_planners_fractions(capsys):
    """With ``--objective fastest`` the recommended plan is priced over the same candidates as the
    planner: at a setup the planner keeps, both name the same fraction of the parameters on the host."""
    assert main(["--params", "7e9", "--hidden", "4096", "--layers", "32", "--heads", "32", "--vocab", "32000",
                 "--gpus", "8", "--micro-batch", "1", "--seq-len", "2048", "--checkpointing", "full",
                 "--device", "H100-80GB", "--gpu-memory", "12GiB", "--objective", "fastest", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    planned = payload["planned"]
    assert (planned["checkpointing"], planned["micro_batch"], planned["activation_offload"]) == ("full", 1, False)
    assert plan_spec(payload["recommended"]).partial_params and payload["recommended"] == planned["plan"]
    assert payload["recommended"] in {plan["name"] for plan in payload["plans"]}
