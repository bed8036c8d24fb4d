"""``--proportions``: the estimator reports the rank with the largest share (largest activations)."""
from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memory_estimator import estimate
from memory_estimator.cli.command import main
from memory_estimator.errors import EstimatorInputError
from memory_estimator.terms.proportions import rank_shares

GPT_7B = dict(params=7e9, hidden=4096, layers=32, heads=32, vocab=32000, seq_len=4096, device="H100-80GB")
FLAGS_7B = ["--params", "7e9", "--hidden", "4096", "--layers", "32", "--heads", "32", "--vocab", "32000",
            "--seq-len", "4096", "--device", "H100-80GB", "--checkpointing", "full"]


@st.composite
def shares(draw):
    weights = draw(st.lists(st.integers(0, 20), min_size=1, max_size=8))
    assume(sum(weights) > 0)
    return [w / sum(weights) for w in weights]


@settings(max_examples=15)
@given(proportions=shares(), micro_batch=st.integers(1, 16))
def test_the_plans_are_those_of_the_largest_share_at_its_micro_batch(proportions, micro_batch) -> None:
    world = len(proportions)
    uneven = estimate(**GPT_7B, world_size=world, micro_batch=micro_batch, proportions=proportions)
    split = uneven.shares
    assert sum(split.micro_batches) == split.global_batch == micro_batch * world
    worst = split.worst_rank
    assert split.micro_batches[worst] == max(split.micro_batches)
    assert proportions[worst] == max(proportions)  # the largest share holds the largest micro-batch
    as_if_equal = estimate(**GPT_7B, world_size=world, micro_batch=split.worst_micro_batch)
    assert [p.to_json_dict() for p in uneven.plans] == [p.to_json_dict() for p in as_if_equal.plans]
    assert uneven.max_micro_batch == as_if_equal.max_micro_batch


def test_worked_example_reports_rank_3_and_its_micro_batch(capsys) -> None:
    split = rank_shares([.25, .25, .10, .40], world_size=4, micro_batch=8)
    assert (split.micro_batches, split.worst_rank, split.worst_micro_batch) == ((8, 8, 3, 13), 3, 13)
    assert main([*FLAGS_7B, "--gpus", "4", "--micro-batch", "2", "--proportions", ".25,.25,.1,.4"]) == 0
    out = capsys.readouterr().out
    assert ("uneven data: worst rank 3 (share 0.4), micro-batch 3 of the global 8 (per rank 2/2/1/3); "
            "the table is for that rank") in out
    assert "micro-batch 3, seq 4096" in out
    assert main([*FLAGS_7B, "--gpus", "4", "--micro-batch", "2", "--proportions", ".25,.25,.1,.4", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["worst_rank"] == {"rank": 3, "share": 0.4, "micro_batch": 3, "micro_batches": [2, 2, 1, 3],
                                     "global_batch": 8}
    assert main([*FLAGS_7B, "--gpus", "4", "--micro-batch", "2", "--json"]) == 0
    assert "worst_rank" not in json.loads(capsys.readouterr().out)  # the schema without the flag is unchanged


def test_step_time_is_the_worst_ranks_and_tokens_count_the_global_batch(capsys) -> None:
    timing = [*FLAGS_7B, "--nodes", "1", "--gpus-per-node", "4", "--json"]
    assert main([*timing, "--micro-batch", "2", "--proportions", ".25,.25,.1,.4"]) == 0
    uneven = json.loads(capsys.readouterr().out)
    assert main([*timing, "--micro-batch", "3"]) == 0  # every rank at the worst rank's micro-batch
    equal_at_worst = json.loads(capsys.readouterr().out)
    for timed, same in zip(uneven["plans"], equal_at_worst["plans"]):
        assert timed["time"]["step_time_s"] == pytest.approx(same["time"]["step_time_s"])
        # the step covers 8 sequences, not 3 x 4
        assert timed["time"]["tokens_per_s"] == pytest.approx(same["time"]["tokens_per_s"] * 8 / 12)


@pytest.mark.parametrize("proportions, message", [
    (".25,.25,.5", "proportions has 3 entries for 4 ranks"),
    (".5,.6,-.1,0", "rank 2 has -0.1"),
    (".3,.3,.3,.3", "must sum to 1"),
    ("a,b,c,d", "comma-separated shares"),
])
def test_bad_proportions_are_one_line_errors(capsys, proportions, message) -> None:
    assert main([*FLAGS_7B, "--gpus", "4", "--proportions", proportions]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_api_raises_the_estimators_input_error() -> None:
    with pytest.raises(EstimatorInputError, match="must sum to 1"):
        estimate(params=1e9, world_size=2, proportions=[.5, .4])
    with pytest.raises(EstimatorInputError, match="a sequence of numbers, one per rank"):
        estimate(params=1e9, world_size=2, proportions="0.5,0.5")
