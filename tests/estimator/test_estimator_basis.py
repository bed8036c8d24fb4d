"""What the answer's totals predict (allocated, reserved, nvidia-smi), how far a reserved reading
can go above them when sequence lengths vary, and the typical-length estimate beside the cap's."""
from __future__ import annotations

import json
from pathlib import Path

from memory_estimator.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LORA_7B = ["--config", str(CONFIGS / "llama-2-7b.json"), "--lora-rank", "16", "--precision", "pure-bf16",
           "--engine", "ddp", "--micro-batch", "4", "--seq-len", "2048", "--device", "A100-80GB"]


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_each_plan_is_given_on_every_reading(capsys):
    _, payload = run(capsys, *LORA_7B)
    basis = payload["setup"]["memory_basis"]
    assert "max_memory_allocated" in basis["total"] and basis["seq_len"] == 2048
    for plan in payload["plans"]:
        readings, buffers = basis["plans"][plan["name"]], plan["buffers"]
        assert readings["nvidia-smi"] == plan["per_rank_bytes"]["total"]
        assert readings["reserved"] == readings["nvidia-smi"] - buffers["cuda_context"] - buffers.get("nccl_buffers", 0)
        assert readings["allocated"] == readings["reserved"] - buffers["allocator_fragmentation"]
    # the variable-length bound is one step's saved activations and logits (this plan peaks in forward)
    ddp = payload["plans"][0]
    assert ddp["peak_moment"] == "forward"
    assert basis["variable_length_excess_bytes"] == ddp["per_rank_bytes"]["activations"] + \
        ddp["buffers"]["logits_and_loss"]


def test_text_and_json_say_the_basis(capsys):
    main(LORA_7B)
    text = capsys.readouterr().out
    _, payload = run(capsys, *LORA_7B)
    note = next(note for note in payload["notes"] if note.startswith("memory basis"))
    assert f"note: {note}" in text
    assert "nvidia-smi" in note and "max_memory_reserved" in note and "if sequence lengths vary" in note


def test_host_ram_has_no_caching_allocator_to_explain(capsys):
    _, payload = run(capsys, "--params", "1e8", "--device", "cpu", "--gpu-memory", "16GiB")
    assert not any(note.startswith("memory basis") for note in payload["notes"])


def test_mean_seq_len_adds_the_typical_step_beside_the_cap(capsys):
    code, capped = run(capsys, *LORA_7B, "--mean-seq-len", "700")
    _, typical = run(capsys, *LORA_7B[:-4], "--seq-len", "700", "--device", "A100-80GB")
    assert capped["seq_len_basis"] == "cap" and capped["setup"]["seq_len"] == 2048
    beside = capped["typical_length"]
    assert beside["seq_len"] == 700 and beside["recommended"] == typical["recommended"]
    assert [p["total"] for p in beside["plans"]] == [p["per_rank_bytes"]["total"] for p in typical["plans"]]
    assert all(p["total"] < c["per_rank_bytes"]["total"] for p, c in zip(beside["plans"], capped["plans"]))
    assert beside["reserved_excess_bytes"] == typical["setup"]["memory_basis"]["variable_length_excess_bytes"]
    main([*LORA_7B, "--mean-seq-len", "700"])
    assert "the table is for the cap, --seq-len 2048; a typical step of 700 tokens" in capsys.readouterr().out


def test_mean_seq_len_must_be_a_length_under_the_cap(capsys):
    for bad in ("4096", "0", "10.5"):
        assert main([*LORA_7B, "--mean-seq-len", bad]) == 2
        assert "--mean-seq-len must be a whole number of tokens from 1 to --seq-len" in capsys.readouterr().err
