"""The memory-estimator as a new user types it.

* ``--gpus 64`` with the time model: nodes of the device's usual size, and said so;
* memory sizes: a bare number is refused (it would be bytes), a negative one gets a message;
* ``--json`` carries every assumption, note, warning and suggestion the table prints;
* names and messages: device aliases, a short message for an unknown ``model_type``,
  the flags named when no model is given, ``--help`` with the subcommand, exit codes, defaults.
"""
import json
from pathlib import Path

import pytest

from memory_estimator.cli.command import build_parser, main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LLAMA_7B = str(CONFIGS / "llama-2-7b.json")
ARCH_7B = ("--params", "7e9", "--hidden", "4096", "--layers", "32", "--heads", "32", "--vocab", "32000")


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def bad_input(capsys, *argv) -> str:
    """Exit code 2 and one line on stderr, no traceback; returns that line."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- 7: node size


def test_gpus_alone_are_spread_over_nodes_of_the_devices_usual_size(capsys):
    code, payload = run_json(capsys, *ARCH_7B, "--gpus", "64", "--device", "H100-80GB", "--objective", "fastest")
    topology = payload["topology"]
    assert code == 0 and (topology["nodes"], topology["gpus_per_node"], topology["world_size"]) == (8, 8, 64)
    assert topology["gpus_per_node_assumed"] is True and "8 GPUs per node" in topology["node_size_note"]
    assert any("8 GPUs per node" in note for note in payload["notes"])
    assert any(plan["name"].startswith("zero3-hsdp") for plan in payload["plans"])  # several nodes: hybrid plans
    assert max(plan["time"]["bytes_per_step"]["inter_node"] for plan in payload["plans"]) > 0
    assert main([*ARCH_7B, "--gpus", "64", "--device", "H100-80GB", "--objective", "fastest"]) == 0
    out = capsys.readouterr().out
    assert "time per step: 8 node(s) x 8 rank(s)" in out and "assumed 8 GPUs per node" in out
    assert "--gpus-per-node" in out  # how to change it


def test_node_size_given_by_the_user_is_taken_as_given(capsys):
    _, payload = run_json(capsys, *ARCH_7B, "--gpus", "64", "--gpus-per-node", "64", "--device", "H100-80GB",
                          "--objective", "fastest")
    topology = payload["topology"]
    assert (topology["nodes"], topology["gpus_per_node"], topology["gpus_per_node_assumed"]) == (1, 64, False)
    _, payload = run_json(capsys, *ARCH_7B, "--gpus", "16", "--gpus-per-node", "4", "--objective", "fastest")
    assert (payload["topology"]["nodes"], payload["topology"]["gpus_per_node"]) == (4, 4)
    _, payload = run_json(capsys, *ARCH_7B, "--gpus", "4", "--objective", "fastest")  # fewer than a node
    assert (payload["topology"]["nodes"], payload["topology"]["gpus_per_node"]) == (1, 4)


def test_gpus_that_are_not_whole_nodes_ask_for_the_topology(capsys):
    err = bad_input(capsys, *ARCH_7B, "--gpus", "12", "--device", "H100-80GB", "--objective", "fastest")
    assert "12" in err and "--nodes" in err and "--gpus-per-node" in err


# --------------------------------------------------------------------------- 8: memory sizes


@pytest.mark.parametrize("flag", ["--gpu-memory", "--bucket-size", "--cuda-context", "--nccl-buffers"])
def test_a_size_without_unit_is_bad_input(capsys, flag):
    err = bad_input(capsys, "--params", "7e9", flag, "24")
    assert f"argument {flag}" in err and "no unit" in err and "24GiB" in err and "24GB" in err


@pytest.mark.parametrize("flag", ["--gpu-memory", "--bucket-size", "--cuda-context"])
def test_a_negative_size_says_so(capsys, flag):
    err = bad_input(capsys, "--params", "7e9", flag, "-24GiB")
    assert "must not be negative" in err or "must be positive" in err
    assert "expected one argument" not in err


def test_zero_overheads_and_sizes_with_units_still_parse(capsys):
    code, payload = run_json(capsys, "--params", "1e9", "--gpu-memory", "24GiB", "--cuda-context", "0",
                             "--bucket-size", "25MiB")
    assert code == 0 and payload["device"]["memory_bytes"] == 24 * 2**30


# --------------------------------------------------------------------------- 9: JSON = table


def _table_remarks(out: str) -> list[str]:
    """The notes, warnings and would-fit suggestions of the text output."""
    prefixes = ("note: ", "warning: ", "  would fit: ")
    return [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(prefixes)]


@pytest.mark.parametrize("argv", [
    ("--params", "7e9", "--gpus", "8"),                                               # activations unknown
    ("--config", str(CONFIGS / "llama-2-70b.json"), "--gpus", "2", "--device", "RTX4090"),  # nothing fits
    ("--config", LLAMA_7B, "--gpus", "8", "--micro-batch", "2", "--seq-len", "4096",
     "--checkpointing", "full", "--optimizer", "sgd", "--amp", "bf16", "--safety-margin", "0.2"),
])
def test_json_carries_everything_the_table_says(capsys, argv):
    main(list(argv))
    remarks = _table_remarks(capsys.readouterr().out)
    _, payload = run_json(capsys, *argv)
    assert remarks and sorted(remarks) == sorted(payload["warnings"] + payload["notes"] + payload["suggestions"])


def test_json_states_the_assumptions(capsys):
    _, payload = run_json(capsys, "--params", "7e9", "--gpus", "8")
    setup = payload["setup"]
    assert (setup["micro_batch"], setup["seq_len"], setup["checkpointing"], setup["optimizer"]) == \
        (1, 2048, "none", "adamw")
    assert setup["safety_margin"] == 0.10 and setup["activations"] == "not estimated"
    assert setup["model_source"] == "params"
    assert payload["device"]["usable_bytes"] == int(payload["device"]["memory_bytes"] * 0.9)
    assert any("activations were not estimated" in warning for warning in payload["warnings"])
    _, payload = run_json(capsys, "--config", LLAMA_7B, "--micro-batch", "3", "--seq-len", "1024",
                          "--checkpointing", "full", "--optimizer", "sgd")
    assert (payload["setup"]["micro_batch"], payload["setup"]["seq_len"], payload["setup"]["checkpointing"],
            payload["setup"]["optimizer"], payload["setup"]["activations"]) == (3, 1024, "full", "sgd", "analytic")
    assert payload["warnings"] == []


# --------------------------------------------------------------------------- 10: names and messages


@pytest.mark.parametrize("name,expected", [
    ("h100", "H100-80GB"), ("H100", "H100-80GB"), ("a100", "A100-80GB"), ("A100", "A100-80GB"),
    ("h100-sxm", "H100-80GB"), ("H100 SXM5", "H100-80GB"), ("a100-sxm4-80gb", "A100-80GB"),
    ("a100-40gb", "A100-40GB"), ("a100_40g", "A100-40GB"), ("h100-80g", "H100-80GB"), ("4090", "RTX4090"),
])
def test_common_device_names_are_accepted(capsys, name, expected):
    code, payload = run_json(capsys, "--params", "1e9", "--device", name)
    assert code == 0 and payload["device"]["name"] == expected


def test_a_near_miss_suggests_the_closest_devices_first(capsys):
    err = bad_input(capsys, "--params", "1e9", "--device", "h100-40")
    assert "did you mean H100-80GB" in err


def test_unknown_model_type_gets_a_short_message_with_close_matches(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "lama", "hidden_size": 64}))
    err = bad_input(capsys, "--config", str(config))
    assert "does not know model_type 'lama'" in err and "did you mean llama" in err
    assert len(err) < 400 and "albert" not in err  # not transformers' whole list of types
    assert "--module" in err and "--params" in err


def test_no_model_names_the_flags(capsys):
    err = bad_input(capsys, "--gpus", "8")
    assert "--params" in err and "--config" in err and "--module" in err


def test_help_names_the_subcommand_exit_codes_and_defaults():
    text = " ".join(build_parser().format_help().split())
    assert "memory-estimator calibrate" in text
    assert "0 a plan fits" in text and "1 no plan fits" in text and "2 bad input" in text
    for default in ("A100-80GB", "sequence 2048", "micro-batch 1"):
        assert default in text
