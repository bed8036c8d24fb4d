"""The time model inside the estimator: engine bytes, CLI flags and JSON, calibration files."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import time_model_cases as cases
from memory_estimator import estimate
from memory_estimator.hardware.calibration import (ENV_PATH, Calibration, calibration_path, fit_alpha_beta,
                                          load_calibration, save_calibration)
from memory_estimator.cli.command import main
from memory_estimator.errors import EstimatorInputError
from memory_estimator.hardware.rates import device_rates
from memory_estimator.hardware.interconnects import Link, resolve_link
from memory_estimator.engines.shardengine_exact import engine_layout
from memory_estimator.timing.step import Cluster, TimedPlan, Workload, plan_collectives, step_time
from memory_estimator.plan.timed import workload_from_estimate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LLAMA_7B = str(CONFIGS / "llama-2-7b.json")
TIME_KEYS = {"step_time_s", "tokens_per_s", "compute_s", "optimizer_s", "comm_s", "exposed_comm_s",
             "bytes_per_step"}


# --------------------------------------------------------------------------- bytes: model == engine


@pytest.mark.parametrize("stage,collectives,micro_steps,reshard", [
    (0, "auto", 1, True), (1, "auto", 2, True), (2, "auto", 2, True), (3, "auto", 2, True), (1, "native", 1, True),
    (3, "native", 1, True), (3, "auto", 2, False), (3, "native", 1, False)])
def test_ring_bytes_equal_the_engine_counters(rank_pools, stage, collectives, micro_steps, reshard):
    """The time model's bytes per step for a module are the engine's ``ring_model_bytes``, which
    equal what its counters record in a real step (Gloo: the in-place forms; native: textbook);
    stage 3 without resharding after forward gathers each unit once per micro-step, not twice."""
    engine = rank_pools.get(2).run(cases.ring_bytes_of_a_step, stage, collectives, micro_steps, None, None,
                                   reshard)[0]
    assert engine["counted"] == engine["ring_model_bytes"] > 0
    result = estimate(module=cases.tiny_gpt, world_size=2, precision="fp32", micro_batch=2, seq_len=cases.SEQ,
                      device="cpu", device_memory_bytes="8GiB", reshard_after_forward=reshard)
    # The link's backend decides the forms, as comm.uses_in_place_primitives does in the engine.
    link = Link("loopback", 1e9, 1e-4, efficiency=1.0, backend="gloo" if collectives == "auto" else "nccl")
    cluster = Cluster(1, 2, link, link, device_rates("A100-80GB"))
    plan = TimedPlan(f"zero{stage}", stage)
    uses = plan_collectives(plan, workload_from_estimate(result, micro_steps, stage), cluster)
    assert sum(use.ring_bytes for use in uses) == engine["ring_model_bytes"]


@pytest.mark.parametrize("stage,collectives,flag", [
    (0, "auto", "int8"), (0, "native", "bf16"), (0, "auto", "grads=powersgd,powersgd_rank=2"),
    (2, "auto", "grads=int8,block_size=64"), (3, "native", "grads=fp16,params=int8"), (3, "auto", "params=int8")])
def test_compressed_ring_bytes_equal_the_engine_counters(rank_pools, stage, collectives, flag):
    """With ``--compression`` the time model's bytes are the compressed engine's ``ring_model_bytes``
    (and its counters): the same all-to-alls, all-gathers and PowerSGD all-reduces, scales included."""
    from memory_estimator.cli.timing_flags import parse_compression_flag
    compression = parse_compression_flag(flag)
    engine = rank_pools.get(2).run(cases.ring_bytes_of_a_step, stage, collectives, 2, None, compression)[0]
    assert engine["counted"] == engine["ring_model_bytes"] > 0
    result = estimate(module=cases.tiny_gpt, world_size=2, precision="fp32", micro_batch=2, seq_len=cases.SEQ,
                      device="cpu", device_memory_bytes="8GiB")
    link = Link("loopback", 1e9, 1e-4, efficiency=1.0, backend="gloo" if collectives == "auto" else "nccl")
    cluster = Cluster(1, 2, link, link, device_rates("A100-80GB"))
    workload = replace(workload_from_estimate(result, 2, stage), compression=compression)
    uses = plan_collectives(TimedPlan(f"zero{stage}", stage), workload, cluster)
    assert sum(use.ring_bytes for use in uses) == engine["ring_model_bytes"]
    exact = plan_collectives(TimedPlan(f"zero{stage}", stage), replace(workload, compression=None), cluster)
    assert sum(use.ring_bytes for use in uses) < sum(use.ring_bytes for use in exact)


def test_compression_flag_reaches_the_time_table(capsys):
    code, out = run_json(capsys, *MULTI_NODE, "--precision", "fp32", "--compression", "int8")
    assert code == 0 and out["topology"]["compression"]["grads"] == "int8"
    code, plain = run_json(capsys, *MULTI_NODE, "--precision", "fp32")
    by_name = {p["name"]: p["time"]["bytes_per_step"]["inter_node"] for p in plain["plans"]}
    assert all(p["time"]["bytes_per_step"]["inter_node"] < by_name[p["name"]] for p in out["plans"]
               if p["name"] in ("ddp", "zero3"))


@pytest.mark.parametrize("argv,phrase", [(("--compression", "zip"), "must be one of"),
                                         (("--precision", "bf16", "--compression", "bf16"), "sends nothing less")])
def test_bad_compression_flag_is_refused(capsys, argv, phrase):
    assert main([*MULTI_NODE, *argv]) == 2
    err = capsys.readouterr().err
    assert phrase in err and err.count("\n") == 1


@pytest.mark.parametrize("stage,collectives", [(1, "auto"), (2, "native"), (3, "auto"), (3, "native")])
def test_hybrid_plan_bytes_per_link_equal_the_engine_counters_per_group(rank_pools, stage, collectives):
    """4 ranks as 2 "nodes" of 2, ``shard_group_size=2``: given the engine's layout over the group,
    the time model's intra-node bytes are the engine's ``intra_group`` counters and its
    inter-node bytes the ``inter_group`` ones plus the all-rank agreement (which spans nodes)."""
    engine = rank_pools.get(4).run(cases.ring_bytes_of_a_step, stage, collectives, 2, 2)[0]
    assert engine["counted"] == engine["ring_model_bytes"] and engine["by_group"]["inter_group"] > 0
    layout = engine_layout(cases.tiny_gpt(), 2)  # buckets and units padded and sharded over k = 2
    workload = Workload(sum(p.numel() for p in cases.tiny_gpt().parameters()), 2 * cases.SEQ,
                        buckets=tuple(padded for padded, _ in layout.buckets),
                        units=tuple(unit[:2] for unit in layout.units), precision="fp32", grad_accum=2,
                        grad_tensors=layout.grad_tensors, buffer_groups=layout.buffer_groups)
    link = Link("loopback", 1e9, 1e-4, efficiency=1.0, backend="gloo" if collectives == "auto" else "nccl")
    cluster = Cluster(2, 2, link, link, device_rates("A100-80GB"))
    timed = step_time(TimedPlan(f"zero{stage}-hsdp2", stage, shard_group_size=2), workload, cluster)
    assert timed.ring_bytes("intra") == engine["by_group"]["intra_group"]
    assert timed.ring_bytes("inter") == engine["by_group"]["inter_group"] + engine["by_group"]["all_ranks"]


# --------------------------------------------------------------------------- CLI


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


MULTI_NODE = ("--config", LLAMA_7B, "--device", "H100-80GB", "--nodes", "4", "--gpus-per-node", "8",
              "--interconnect", "ib-ndr", "--seq-len", "4096")


def test_json_gains_time_fields_and_hybrid_plans(capsys):
    code, payload = run_json(capsys, *MULTI_NODE)
    assert code == 0 and payload["world_size"] == 32
    names = [p["name"] for p in payload["plans"]]
    assert names == ["ddp", "zero1", "zero2", "zero3", "zero3-offload", "zero3-offload-params",
                     "zero1-hsdp8", "zero2-hsdp8", "zero3-hsdp8"]
    for plan in payload["plans"]:
        assert TIME_KEYS <= set(plan["time"]) and plan["time"]["step_time_s"] > 0
        assert plan["shard_group_size"] == (8 if "hsdp" in plan["name"] else 32)
        assert plan["time"]["tokens_per_s"] == pytest.approx(4096 * 32 / plan["time"]["step_time_s"])
    topology = payload["topology"]
    assert (topology["nodes"], topology["gpus_per_node"]) == (4, 8)
    assert topology["inter_node"]["name"] == "ib-ndr" and topology["intra_node"]["name"] == "nvlink4"
    assert payload["objective"] == "least-sharded"
    assert payload["recommended"] == payload["recommended_least_sharded"] == "zero1"
    hybrid = {p["name"]: p for p in payload["plans"]}["zero3-hsdp8"]
    flat = {p["name"]: p for p in payload["plans"]}["zero3"]
    assert hybrid["time"]["bytes_per_step"]["inter_node"] < flat["time"]["bytes_per_step"]["inter_node"]
    # Memory of the hybrid plan is stage 3's with N -> 8: more than over 32 ranks.
    assert hybrid["per_rank_bytes"]["optimizer_states"] == pytest.approx(
        4 * flat["per_rank_bytes"]["optimizer_states"], rel=1e-6)


def test_objective_fastest_recommends_the_fastest_plan_that_fits(capsys):
    code, payload = run_json(capsys, *MULTI_NODE, "--objective", "fastest")
    assert code == 0
    fitting = [p for p in payload["plans"] if p["fits"]]
    fastest = min(fitting, key=lambda p: p["time"]["step_time_s"])
    assert payload["recommended"] == fastest["name"] and payload["objective"] == "fastest"
    assert payload["recommended_least_sharded"] == "zero1"


def test_without_time_flags_the_schema_is_unchanged(capsys):
    _, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8")
    assert set(payload) == {"params", "world_size", "device", "plans", "recommended", "max_micro_batch",
                            "engine", "precision",  # the engine and precision estimated
                            "setup", "warnings", "notes", "suggestions",  # what the table says besides
                            "capacity"}  # the node's host RAM and disk the plans were judged on
    assert all("time" not in plan for plan in payload["plans"])


def test_table_shows_time_per_step_beside_memory(capsys):
    assert main([*MULTI_NODE, "--objective", "fastest"]) == 0
    out = capsys.readouterr().out
    assert "per rank (GiB)" in out and "time per step: 4 node(s) x 8 rank(s)" in out
    for row in ("memory (GiB)", "step s", "tokens/s", "comm exposed s", "GB inter/step"):
        assert f"\n{row} " in out
    assert "objective fastest: recommended zero" in out


@pytest.mark.parametrize("argv,phrase", [
    (("--gpus", "16", "--nodes", "4", "--gpus-per-node", "8"), "disagrees"),
    (("--nodes", "2", "--interconnect", "infiniband"), "unknown interconnect"),
    (("--nodes", "0"), "at least 1"),
    (("--nodes", "2", "--gpus-per-node", "8", "--shard-group-size", "3"), "must divide"),
    (("--nodes", "2", "--gpu-memory", "24GiB"), "no compute rate"),
    (("--nodes", "2", "--compute-efficiency", "1.5"), "efficiency"),
])
def test_bad_time_model_input_exits_2_with_one_line(capsys, argv, phrase):
    assert main(["--params", "1e9", *argv]) == 2
    err = capsys.readouterr().err
    assert phrase in err and err.count("\n") == 1


# --------------------------------------------------------------------------- calibration


@given(st.floats(1e-7, 1e-2), st.floats(1e-12, 1e-7))
def test_fit_recovers_alpha_and_beta(alpha, beta):
    points = [(steps, size, steps * alpha + size * beta) for steps in (2, 4) for size in (0, 1e4, 1e6, 1e8)]
    got_alpha, got_beta = fit_alpha_beta(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)


def test_fit_clamps_a_negative_latency_to_zero():
    alpha, beta = fit_alpha_beta([(2, 1e6, 0.9e-3), (2, 2e6, 2.1e-3), (2, 4e6, 4.0e-3)])
    assert alpha == 0.0 and beta > 0


def _calibration(**changes) -> Calibration:
    values = dict(backend="gloo", world_size=2, alpha_s=1e-4, beta_s_per_byte=1e-9, matmul_flops=5e10,
                  training_flops=2.5e10, optimizer_bytes_per_s=2e9, overlap=0.25)
    return Calibration(**{**values, **changes})


def test_calibration_round_trips_through_the_env_path(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "cal.json"
    monkeypatch.setenv(ENV_PATH, str(path))
    assert calibration_path() == path
    save_calibration(_calibration())
    assert load_calibration() == _calibration()
    link = resolve_link("this-machine")
    assert (link.latency_s, link.overlap, link.backend) == (1e-4, 0.25, "gloo")
    assert link.bandwidth_bytes_per_s == pytest.approx(1e9)


def test_missing_or_broken_calibration_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV_PATH, str(tmp_path / "none.json"))
    with pytest.raises(EstimatorInputError, match="run `memory-estimator calibrate` first"):
        load_calibration()
    assert main(["--params", "1e8", "--device", "this-machine", "--interconnect", "this-machine",
                 "--gpus", "2"]) == 2
    assert "memory-estimator calibrate" in capsys.readouterr().err
    (tmp_path / "none.json").write_text("{not json")
    with pytest.raises(EstimatorInputError, match="cannot read"):
        load_calibration()
    save_calibration(_calibration(beta_s_per_byte=0.0))
    with pytest.raises(EstimatorInputError, match="non-positive rate"):
        load_calibration()


def test_estimates_use_the_stored_calibration(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV_PATH, str(tmp_path / "cal.json"))
    save_calibration(_calibration())
    code, payload = run_json(capsys, "--params", "1e8", "--device", "this-machine", "--intra-node", "this-machine",
                             "--gpus", "2", "--precision", "fp32", "--seq-len", "256")
    assert code == 0
    topology = payload["topology"]
    assert topology["intra_node"]["latency_s"] == 1e-4
    assert topology["intra_node"]["nominal_bytes_per_s"] == pytest.approx(1e9)
    assert topology["compute_efficiency"] == 0.5 and topology["peak_flops"] == 5e10
    ddp = payload["plans"][0]["time"]
    assert ddp["compute_s"] == pytest.approx(6 * 1e8 * 256 / 2.5e10)
    assert ddp["optimizer_s"] == pytest.approx(28 * 1e8 / 2e9)


def test_calibrate_measures_and_stores(rank_pools, tmp_path):
    out = tmp_path / "calibration.json"
    rank_pools.get(2).run(cases.calibrate_on_ranks, ["--rounds", "1", "--sizes-kib", "16,1024", "--hidden", "64",
                                                     "--seq-len", "32", "--out", str(out)], timeout=120)
    calibration = load_calibration(out)
    assert calibration.backend == "gloo" and calibration.world_size == 2
    assert calibration.beta_s_per_byte > 0 and calibration.alpha_s >= 0
    assert calibration.matmul_flops > 0 and calibration.training_flops > 0 and calibration.optimizer_bytes_per_s > 0
    assert 0 <= calibration.overlap <= 1
    assert {sample[0] for sample in calibration.samples} == {"all_reduce", "all_gather"}


def test_hybrid_group_defaults_to_the_smallest_that_fits(capsys):
    """70B on 8 x 8 H100: stage 3 sharded over one node (8) or two (16) does not fit; over four does."""
    argv = ("--config", str(CONFIGS / "llama-2-70b.json"), "--device", "H100-80GB", "--nodes", "8",
            "--gpus-per-node", "8", "--micro-batch", "4", "--seq-len", "4096", "--checkpointing", "full")
    _, payload = run_json(capsys, *argv)
    hybrid = {p["stage"]: p for p in payload["plans"] if "hsdp" in p["name"]}
    assert hybrid[3]["name"] == "zero3-hsdp32" and hybrid[3]["fits"] and hybrid[3]["shard_group_size"] == 32
    for k in (8, 16):
        _, payload = run_json(capsys, *argv, "--shard-group-size", str(k))
        (plan,) = [p for p in payload["plans"] if p["name"] == f"zero3-hsdp{k}"]
        assert not plan["fits"]


def test_calibration_never_stores_an_infinitely_fast_link():
    """Noise that leaves no slope (the larger buffer was not slower) still gives beta > 0."""
    from types import SimpleNamespace

    from memory_estimator.measure.calibrate import _alpha_beta

    comm = SimpleNamespace(in_place_primitives=True, world_size=2)
    samples = [("all_reduce", 16384, 16384, 2e-3), ("all_reduce", 1 << 20, 1 << 20, 1e-3),
               ("all_gather", 1 << 19, 1 << 20, 1e-3)]
    alpha, beta = _alpha_beta(comm, samples)
    assert alpha > 0 and beta == pytest.approx(1e-3 / (1 << 20) * 1.5)
