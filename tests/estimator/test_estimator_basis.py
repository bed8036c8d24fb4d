"""What the answer's totals predict (allocated, reserved, nvidia-smi), what varying lengths add to the
reserved readings (the allocator replayed), the verdict on that basis, and the typical-length estimate."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memory_estimator import estimate
from memory_estimator.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LORA_7B = ["--config", str(CONFIGS / "llama-2-7b.json"), "--lora-rank", "16", "--precision", "pure-bf16",
           "--engine", "ddp", "--micro-batch", "4", "--seq-len", "2048", "--device", "A100-80GB"]
CACHED = "cached_segments_other_lengths"


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_each_plan_is_given_on_every_reading(capsys):
    _, payload = run(capsys, *LORA_7B)
    basis = payload["setup"]["memory_basis"]
    assert "max_memory_allocated" in basis["total"] and basis["seq_len"] == 2048
    assert basis["lengths"] is None and basis["variable_length_excess_bytes"] is None
    for plan in payload["plans"]:
        readings, buffers = basis["plans"][plan["name"]], plan["buffers"]
        assert readings["nvidia-smi"] == plan["per_rank_bytes"]["total"]
        assert readings["reserved"] == readings["nvidia-smi"] - buffers["cuda_context"] - buffers.get("nccl_buffers", 0)
        assert readings["allocated"] == readings["reserved"] - buffers["allocator_fragmentation"]


def test_text_and_json_say_the_basis(capsys):
    main(LORA_7B)
    text = capsys.readouterr().out
    _, payload = run(capsys, *LORA_7B)
    note = next(note for note in payload["notes"] if note.startswith("memory basis"))
    assert f"note: {note}" in text
    assert "nvidia-smi" in note and "max_memory_reserved" in note and "--length-histogram" in note


def test_host_ram_has_no_caching_allocator_to_explain(capsys):
    _, payload = run(capsys, "--params", "1e8", "--device", "cpu", "--gpu-memory", "16GiB")
    assert not any(note.startswith("memory basis") for note in payload["notes"])


def test_varying_lengths_add_cached_segments_to_reserved_not_to_allocated(capsys):
    _, fixed = run(capsys, *LORA_7B[:-6], "--micro-batch", "1", "--seq-len", "2048", "--device", "H100-80GB",
                   "--checkpointing", "full")
    _, varying = run(capsys, *LORA_7B[:-6], "--micro-batch", "1", "--seq-len", "2048", "--device", "H100-80GB",
                     "--checkpointing", "full", "--mean-seq-len", "900", "--steps", "300")
    basis = varying["setup"]["memory_basis"]
    assert basis["lengths"]["source"] == "mean" and basis["lengths"]["steps"] == 300
    fixed_ddp, ddp = fixed["plans"][0], varying["plans"][0]
    excess = ddp["buffers"][CACHED]
    assert excess > 0 and basis["variable_length_excess_bytes"] == excess
    assert ddp["per_rank_bytes"]["total"] == fixed_ddp["per_rank_bytes"]["total"] + excess
    readings, fixed_readings = basis["plans"]["ddp"], fixed["setup"]["memory_basis"]["plans"]["ddp"]
    assert readings["allocated"] == fixed_readings["allocated"]
    assert readings["reserved"] == fixed_readings["reserved"] + excess
    cached = next(term for term in ddp["confidence"]["terms"] if term["term"] == CACHED)
    assert cached["basis"] == "assumption" and cached["low"] <= cached["bytes"] <= cached["high"]
    assert any("longest-last" in line for line in ddp["confidence"]["unbounded"])


def test_the_verdict_is_judged_on_the_reserved_peak(capsys):
    # fits at a fixed length; with lengths that vary, the segments they leave cached do not fit the margin
    base = ["--config", str(CONFIGS / "llama-2-7b.json"), "--lora-rank", "16", "--precision", "pure-bf16",
            "--engine", "ddp", "--micro-batch", "2", "--seq-len", "4096", "--device", "A100-40GB",
            "--checkpointing", "full"]
    code, fixed = run(capsys, *base)
    assert code == 0 and fixed["plans"][0]["device_verdict"] == "fits"
    _, varying = run(capsys, *base, "--mean-seq-len", "1500")
    ddp = varying["plans"][0]
    assert ddp["device_verdict"] == "tight" and not ddp["fits"]
    assert any("reserved reaches the device" in line for line in ddp["confidence"]["turns_on"])


def test_a_histogram_states_the_lengths_and_expandable_segments_keep_less(tmp_path):
    histogram = tmp_path / "lengths.txt"
    histogram.write_text("# length count\n200 50\n700 30\n1500 15\n3000 5\n")
    common = dict(config=str(CONFIGS / "llama-2-7b.json"), lora_rank=16, precision="pure-bf16", engine="ddp",
                  micro_batch=2, seq_len=2048, device="H100-80GB", checkpointing="full", steps=300)
    stated = estimate(**common, length_histogram=str(histogram))
    expandable = estimate(**common, length_histogram=str(histogram), expandable_segments=True)
    term = next(t for t in stated.plans[0].confidence.terms if t.term == CACHED)
    assert term.basis == "modelled" and stated.shape_cache.lengths.source == "histogram"
    assert expandable.plans[0].buffers.get(CACHED, 0) < stated.plans[0].buffers[CACHED]
    # truncated at the cap, a padded batch of 2 reaches it with P = 1 - 0.95^2
    assert stated.shape_cache.lengths.reaches_cap == pytest.approx(1 - 0.95**2)


def test_mean_seq_len_adds_the_typical_step_beside_the_cap(capsys):
    code, capped = run(capsys, *LORA_7B, "--mean-seq-len", "700")
    _, typical = run(capsys, *LORA_7B[:-4], "--seq-len", "700", "--device", "A100-80GB")
    assert capped["seq_len_basis"] == "cap" and capped["setup"]["seq_len"] == 2048
    beside = capped["typical_length"]
    assert beside["seq_len"] == 700 and beside["recommended"] == typical["recommended"]
    assert [p["total"] for p in beside["plans"]] == [p["per_rank_bytes"]["total"] for p in typical["plans"]]
    assert all(p["total"] < c["per_rank_bytes"]["total"] for p, c in zip(beside["plans"], capped["plans"]))
    main([*LORA_7B, "--mean-seq-len", "700"])
    assert "the table is for the cap, --seq-len 2048" in capsys.readouterr().out


def test_mean_seq_len_must_be_a_length_under_the_cap(capsys):
    for bad in ("4096", "0", "10.5"):
        assert main([*LORA_7B, "--mean-seq-len", bad]) == 2
        assert "--mean-seq-len must be a whole number of tokens from 1 to --seq-len" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "100"], "--steps and --over-cap describe varying lengths"),
    (["--mean-seq-len", "700", "--length-histogram", "x.json"], "not both"),
    (["--length-histogram", "/nonexistent/lengths.json"], "cannot read the length histogram"),
    (["--mean-seq-len", "700", "--steps", "0"], "--steps must be a whole number"),
])
def test_bad_length_flags_are_refused(capsys, argv, message):
    assert main([*LORA_7B, *argv]) == 2
    assert message in capsys.readouterr().err
