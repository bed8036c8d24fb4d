"""The memory-estimator console script: exit codes, the --json schema, one-line errors."""
import json
import subprocess
from pathlib import Path

import pytest

from memory_estimator.cli.command import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LLAMA_7B = str(CONFIGS / "llama-2-7b.json")
# The documented schema; fields added since (verdict, peak moment, host bytes, named
# buffers, engine, precision) come on top and never replace one.
PLAN_KEYS = {"name", "stage", "offload", "per_rank_bytes", "fits", "verdict", "peak_moment", "host_bytes", "buffers",
             "outside_allocator_bytes", "drivers", "confidence",
             # capacity in every verdict: the device's alone, the node's host RAM and disk
             "device_verdict", "host_verdict", "disk_verdict", "host_bytes_per_node", "disk_bytes_per_node"}
TERM_KEYS = {"params", "grads", "optimizer_states", "activations", "working_set", "overhead", "total"}


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_json_schema_is_exact(capsys):
    code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--device", "A100-80GB",
                             "--micro-batch", "1", "--seq-len", "4096")
    assert code == 0
    assert set(payload) == {"params", "world_size", "device", "plans", "recommended", "max_micro_batch",
                            "engine", "precision", "setup", "warnings", "notes", "suggestions", "capacity"}
    assert (payload["engine"], payload["precision"]) == ("shardengine", "bf16")
    assert payload["params"] == 6_738_415_616 and payload["world_size"] == 8
    assert set(payload["device"]) == {"name", "memory_bytes", "usable_bytes"}
    assert payload["device"]["name"] == "A100-80GB"
    assert [p["name"] for p in payload["plans"]] == ["ddp", "zero1", "zero2", "zero3", "zero3-offload",
                                                   "zero3-offload-params"]
    assert [(p["stage"], p["offload"]) for p in payload["plans"]] == [(0, False), (1, False), (2, False),
                                                                     (3, False), (3, True), (3, True)]
    for plan in payload["plans"]:
        assert set(plan) == PLAN_KEYS and set(plan["per_rank_bytes"]) == TERM_KEYS
        assert all(isinstance(v, int) for v in plan["per_rank_bytes"].values())
    assert payload["recommended"] == "zero1" and payload["max_micro_batch"] >= 1


def test_exit_1_when_nothing_fits(capsys):
    code, payload = run_json(capsys, "--config", str(CONFIGS / "llama-2-70b.json"), "--gpus", "2",
                             "--device", "RTX4090", "--seq-len", "4096")
    assert code == 1 and payload["recommended"] is None and payload["max_micro_batch"] is None
    assert not any(plan["fits"] for plan in payload["plans"])


def test_table_lists_every_term_and_suggestions(capsys):
    assert main(["--config", str(CONFIGS / "llama-2-70b.json"), "--gpus", "2", "--device", "RTX4090"]) == 1
    table = capsys.readouterr().out
    for term in TERM_KEYS | {"headroom", "fits"}:
        assert f"\n{term} " in table
    assert "recommended: none fits" in table and "would fit:" in table


def test_params_only_warns_that_activations_were_not_estimated(capsys):
    assert main(["--params", "1e9", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "warning: activations were not estimated" in out and "24.00 GiB" in out


def test_params_with_architecture_flags_estimates_activations(capsys):
    code, payload = run_json(capsys, "--params", "7e9", "--hidden", "4096", "--layers", "32", "--heads", "32",
                             "--vocab", "32000", "--gpus", "8", "--seq-len", "4096")
    zero3 = next(plan for plan in payload["plans"] if plan["name"] == "zero3")
    # 34·sbh per layer, plus the final norm's input and the LM head's input (2·sbh each)
    assert code == 0 and zero3["per_rank_bytes"]["activations"] == (32 * 34 + 4) * 4096 * 4096


def test_list_devices(capsys):
    assert main(["--list-devices"]) == 0
    assert "H100-80GB" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--params", "-7e9"], "params must be at least 1"),
    (["--params", "1e40"], "implausibly large"),
    (["--params", "7e9", "--gpus", "0"], "world size must be at least 1"),
    (["--config", "/no/such/config.json"], "config file not found"),
    (["--config", str(CONFIGS)], "config file not found"),
    (["--params", "7e9", "--device", "A100-80"], "did you mean A100-80GB"),
    (["--params", "7e9", "--gpu-memory", "lots"], "cannot read memory size"),
    (["--params", "7e9", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--params", "seven"], "not a number"),
    (["--params", "7e9", "--config", LLAMA_7B], "give exactly one of params, config or module"),
    (["--module", "nope"], "must look like package.module:build_fn"),
    (["--params", "7e9", "--checkpointing", "sometimes"], "unknown checkpointing 'sometimes'"),
    (["--params", "7e9", "--engine", "jax"], "invalid choice: 'jax'"),
    (["--params", "7e9", "--cuda-context", "lots"], "cannot read memory size"),
    (["--params", "7e9", "--precision", "bf16", "--amp", "bf16"], "runs over fp32 weights"),
    (["--params", "7e9", "--engine", "fsdp2", "--no-reshard-after-forward"], "read its zero2 plan"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unknown_architecture_and_malformed_config(tmp_path, capsys, monkeypatch):
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({"model_type": "no-such-model"}))
    assert main(["--config", str(unknown)]) == 2
    err = capsys.readouterr().err
    assert "does not know model_type 'no-such-model'" in err and "--module" in err and "--params" in err
    import memory_estimator.model.hf_meta as hf_meta
    monkeypatch.setattr(hf_meta, "transformers_available", lambda: False)
    unknown.write_text(json.dumps({"model_type": "t5"}))
    assert main(["--config", str(unknown)]) == 2
    err = capsys.readouterr().err
    assert "without transformers installed" in err and "bert, bloom, deepseek_v2" in err and "--module" in err
    unknown.write_text("{not json")
    assert main(["--config", str(unknown)]) == 2
    assert "malformed JSON" in capsys.readouterr().err


def test_cuda_context_zero_is_accepted(capsys):
    code, payload = run_json(capsys, "--params", "1e9", "--cuda-context", "0", "--nccl-buffers", "0",
                             "--fragmentation", "0", "--gpus", "2")
    assert code == 0
    assert all("cuda_context" not in plan["buffers"] and "nccl_buffers" not in plan["buffers"]
               for plan in payload["plans"])


def test_engines_list_their_own_plans(capsys):
    expected = {"shardengine": ["ddp", "zero1", "zero2", "zero3", "zero3-offload", "zero3-offload-params"],
                "ddp": ["ddp", "zero1"],
                "fsdp2": ["zero2", "zero3", "zero3-offload-params"],
                "deepspeed": ["ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload",
                              "zero3-offload-params"]}
    for engine, plans in expected.items():
        code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--engine", engine)
        assert [plan["name"] for plan in payload["plans"]] == plans and payload["engine"] == engine


def test_deepspeed_config_sets_knobs_precision_and_micro_batch(tmp_path, capsys):
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
                                     "zero_optimization": {"stage": 3, "reduce_bucket_size": 1e6,
                                                           "stage3_prefetch_bucket_size": "auto"}}))
    code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--engine", "deepspeed",
                             "--deepspeed-config", str(ds_config), "--seq-len", "1024")
    assert code == 0 and payload["precision"] == "fp16"
    zero3 = next(plan for plan in payload["plans"] if plan["name"] == "zero3")
    assert zero3["buffers"]["reduce_bucket"] == 2 * 10**6
    ds_config.write_text("[1]")
    assert main(["--params", "1e9", "--engine", "deepspeed", "--deepspeed-config", str(ds_config)]) == 2
    assert "must hold a JSON object" in capsys.readouterr().err


def test_offload_params_plan_reports_host_memory(capsys):
    assert main(["--config", LLAMA_7B, "--engine", "deepspeed", "--device", "A100-40GB"]) == 0
    out = capsys.readouterr().out
    assert "zero3-offload-params: host RAM" in out


def test_breakdown_names_the_buffers(capsys):
    assert main(["--config", LLAMA_7B, "--gpus", "8", "--engine", "ddp", "--breakdown"]) in (0, 1)
    out = capsys.readouterr().out
    assert "ddp_gradient_buckets" in out and "optimizer_step_temporaries" in out


def test_subcommands_dispatch_before_the_memory_flags(monkeypatch):
    import memory_estimator.cli.command as cli
    seen = []
    monkeypatch.setitem(cli.SUBCOMMANDS, "probe", lambda argv: seen.append(list(argv)) or 7)
    assert main(["probe", "--anything"]) == 7 and seen == [["--anything"]]


def test_console_entry_point_runs_as_a_process(forked_python):
    done = subprocess.run([forked_python.python, "-m", "memory_estimator.cli", "--params", "7e9", "--gpus", "0"],
                          env=forked_python.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("memory-estimator: error: world size")
    assert "Traceback" not in done.stderr


def test_a_fraction_or_budget_of_the_parameters_on_the_host_is_a_plan_of_its_own(capsys):
    plans = {}
    for flag, value in (("--offload-params", "0.5"), ("--offload-device-budget", "4GiB")):
        code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--device", "A100-80GB", flag, value)
        assert code == 0
        plans.update({p["name"]: p for p in payload["plans"]})
    zero3, half, budget = plans["zero3"], plans["zero3-offload-params-0.5"], plans[f"zero3-offload-params-budget-{4 * 2**30}B"]
    for plan in (half, budget):
        assert plan["stage"] == 3 and 0 < plan["host_bytes"] < plans["zero3-offload-params"]["host_bytes"]
        assert plan["per_rank_bytes"]["optimizer_states"] < zero3["per_rank_bytes"]["optimizer_states"]
    device = budget["per_rank_bytes"]
    assert device["params"] + device["optimizer_states"] <= 4 * 2**30  # the budget bounds the model states


@pytest.mark.parametrize("argv, message", [
    (["--offload-params", "1.5"], "a fraction must be"),
    (["--offload-params", "0"], "a fraction must be"),
    (["--offload-device-budget", "-1GiB"], ""),
    (["--offload-params", "0.5", "--engine", "fsdp2"], "shardengine plan"),
    (["--offload-params", "0.5", "--offload-device-budget", "1GiB"], "not both"),
])
def test_bad_fractions_and_budgets_are_refused_on_the_command_line(capsys, argv, message):
    assert main(["--params", "1e9", *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_reshard_after_forward_keeps_every_unit_gathered_at_stage_3(capsys):
    """``--no-reshard-after-forward`` (``shard(stage=3, reshard_after_forward=False)``): stage 3
    holds every unit's bf16 parameters beside the activations, and writes so in ``--emit``;
    stages 0-2 do not change."""
    plans = {}
    for flag in ("--reshard-after-forward", "--no-reshard-after-forward"):
        code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--device", "A100-80GB", flag)
        assert code == 0
        plans[flag] = {plan["name"]: plan for plan in payload["plans"]}
    resharded, kept = plans["--reshard-after-forward"], plans["--no-reshard-after-forward"]
    assert kept["zero3"]["peak_moment"] == "forward"
    assert kept["zero3"]["buffers"]["gathered_units"] == 2 * 6_738_415_616
    assert resharded["zero3"]["buffers"]["gathered_units"] < kept["zero3"]["buffers"]["gathered_units"]
    assert all(kept[name] == resharded[name] for name in ("ddp", "zero1", "zero2"))
    code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--device", "A100-40GB",
                             "--no-reshard-after-forward", "--objective", "fastest", "--emit", "shardengine")
    assert code == 0
    emitted = payload["emit"]["config"]
    assert "stage=3, reshard_after_forward=False" in emitted, emitted
    code, payload = run_json(capsys, "--config", LLAMA_7B, "--gpus", "8", "--device", "A100-40GB",
                             "--no-reshard-after-forward", "--objective", "fastest", "--emit", "fsdp2")
    assert code == 0 and "reshard_after_forward=False" in payload["emit"]["config"], payload["emit"]
