"""Typed requests and the library API of step time: the same answers as the flat keywords and the CLI."""
from __future__ import annotations

import json

import pytest

from memory_estimator import (EngineRequest, EstimateRequest, EstimatorInputError, FineTuningRequest, ModelRequest,
                              TargetRequest, TimingRequest, TrainingRequest, estimate, fastest_plan, time_estimate)
from memory_estimator.cli.command import main

SHAPE = dict(params=1e9, hidden=2048, layers=16, heads=16, vocab=32000)


def test_a_typed_request_answers_as_its_flat_keywords():
    flat = estimate(**SHAPE, world_size=4, micro_batch=2, seq_len=1024, checkpointing="full", lora_rank=8,
                    engine="fsdp2", reduce_dtype="fp32", device="H100-80GB", safety_margin=0.2)
    typed = estimate(EstimateRequest(
        ModelRequest(**SHAPE),
        TrainingRequest(world_size=4, micro_batch=2, seq_len=1024, checkpointing="full"),
        FineTuningRequest(lora_rank=8),
        EngineRequest(name="fsdp2", reduce_dtype="fp32"),
        TargetRequest(device="H100-80GB", safety_margin=0.2)))
    assert typed.to_json_dict() == flat.to_json_dict()


def test_keywords_change_a_request():
    request = EstimateRequest(ModelRequest(**SHAPE), TrainingRequest(world_size=8, seq_len=1024))
    assert estimate(request, seq_len=4096).to_json_dict() == estimate(**SHAPE, world_size=8,
                                                                      seq_len=4096).to_json_dict()
    assert request.training.seq_len == 1024  # the request itself is frozen


def test_an_unknown_keyword_names_the_field_meant():
    with pytest.raises(TypeError, match=r"'seq_length' \(did you mean 'seq_len', a field of TrainingRequest\?\)"):
        estimate(**SHAPE, seq_length=4096)


def test_a_positional_model_is_refused_with_the_way_to_ask():
    with pytest.raises(TypeError, match="takes an EstimateRequest or keywords"):
        estimate(7e9)


def _cli_json(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_the_library_times_and_plans_as_the_cli(capsys):
    flags = ["--params", "1e9", "--hidden", "2048", "--layers", "16", "--heads", "16", "--vocab", "32000",
             "--device", "H100-80GB", "--seq-len", "2048", "--micro-batch", "2"]
    cli = _cli_json(flags + ["--nodes", "2", "--gpus-per-node", "8", "--grad-accum", "2", "--objective", "fastest",
                             "--json"], capsys)
    result = estimate(**SHAPE, world_size=16, micro_batch=2, seq_len=2048, grad_accum=2, device="H100-80GB")
    request = TimingRequest(nodes=2, gpus_per_node=8, grad_accum=2, objective="fastest")
    timed = time_estimate(result, request)
    assert [plan["name"] for plan in cli["plans"]] == [plan.name for plan in timed.plans]
    assert [plan["time"] for plan in cli["plans"]] == [time.to_json_dict() for time in timed.times]
    assert cli["recommended"] == timed.recommended
    assert cli["planned"] == fastest_plan(result, request).to_json_dict()


def test_a_cluster_that_is_not_the_estimate_is_refused():
    result = estimate(**SHAPE, world_size=8, device="H100-80GB")
    with pytest.raises(EstimatorInputError, match="not the estimate's world size 8"):
        time_estimate(result, TimingRequest(nodes=2, gpus_per_node=8))
    with pytest.raises(EstimatorInputError, match="nodes must be a whole number >= 1"):
        TimingRequest(nodes=0, gpus_per_node=8)
    with pytest.raises(EstimatorInputError, match="unknown objective"):
        TimingRequest(nodes=1, gpus_per_node=8, objective="cheapest")
