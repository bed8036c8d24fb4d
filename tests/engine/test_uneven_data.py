"""Uneven data: per-rank batches of any size (0 included), and ranks that run out early.

The engine weights each rank's gradient by its samples, so training equals one
process on the union of the samples actually seen, at every stage, with
accumulation and clipping; under ``model.join()`` ranks with fewer batches keep
serving the others' collectives (zero-weight micro-steps) instead of hanging.
Workers are in ``uneven_cases``.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine_cases import check_equivalence
from rank_pool import RankPoolRegistry
from uneven_cases import lr_differs_on_rank1, nested_join, raise_inside_join_on_rank1, train_uneven

STAGES = [0, 1, 2, 3]


pytestmark = pytest.mark.prestart(2, 3, 4)  # start-ups overlap (conftest.py)


def spec_with(world: int, sizes: list, **overrides) -> dict:
    spec = dict(seed=0, vocab=11, dim=7, hidden=[5, 3], stage=0, optimizer="adamw", micro_steps=1,
                steps=len(sizes), max_norm=None, bucket_mb=25.0, sizes=sizes, world=world)
    spec.update(overrides)
    return spec


@st.composite
def uneven_specs(draw, join: bool) -> tuple[int, dict]:
    world, stage = draw(st.sampled_from([(w, s) for s in STAGES for w in (2, 3, 4)]))
    micro_steps = draw(st.integers(min_value=1, max_value=3))
    steps = draw(st.integers(min_value=2, max_value=3))
    per_rank = st.lists(st.integers(min_value=0, max_value=5), min_size=world, max_size=world)
    sizes = [[draw(per_rank) for _ in range(micro_steps)] for _ in range(steps)]
    spec = spec_with(world, sizes, seed=draw(st.integers(0, 2**16)), stage=stage, micro_steps=micro_steps,
                     hidden=draw(st.lists(st.sampled_from([2, 3, 5, 7]), min_size=1, max_size=3)),
                     optimizer=draw(st.sampled_from(["sgd_momentum", "adamw"])),
                     max_norm=draw(st.sampled_from([None, 0.05, 1e3])),
                     bucket_mb=draw(st.sampled_from([25.0, 0.0005])))
    if join:
        spec["join"] = True
        spec["fewer"] = draw(st.lists(st.integers(min_value=0, max_value=min(3, steps)),
                                      min_size=world, max_size=world))
        spec["schedule"] = draw(st.booleans())  # a joined rank steps with the active ranks' lr
    return world, spec


# A rank with no samples in a step, at every stage; one with the whole step's data.
@example(example=(4, spec_with(4, [[[2, 0, 1, 4]], [[0, 0, 3, 1]]], stage=3, max_norm=0.05)))
@example(example=(3, spec_with(3, [[[5, 0, 1], [0, 2, 2]], [[1, 1, 0], [3, 0, 0]]], stage=2, micro_steps=2)))
@example(example=(2, spec_with(2, [[[0, 0]], [[4, 1]]], stage=1, optimizer="sgd_momentum")))
@settings(max_examples=10)
@given(example=uneven_specs(join=False))
def test_uneven_batches_equal_one_process_on_their_union(rank_pools: RankPoolRegistry,
                                                         example: tuple[int, dict]) -> None:
    world, spec = example
    check_equivalence(rank_pools.get(world).run(train_uneven, spec))


# Stage 3 with a rank that has no batch at all (it replays an input another rank sends).
@example(example=(3, spec_with(3, [[[1, 2, 3]], [[2, 2, 2]], [[3, 1, 1]]], stage=3, join=True, fewer=[3, 0, 1],
                               max_norm=0.05, schedule=True)))
@example(example=(2, spec_with(2, [[[2, 3], [1, 1]], [[2, 2], [4, 0]]], stage=0, micro_steps=2, join=True,
                               fewer=[0, 2], max_norm=0.05)))
# Two epochs: the rank that joined early advances its LR scheduler to model.steps_taken.
@example(example=(3, spec_with(3, [[[1, 2, 3]], [[2, 2, 2]], [[3, 1, 1]]], stage=2, join=True, fewer=[2, 0, 1],
                               schedule=True, epochs=2)))
@settings(max_examples=10)
@given(example=uneven_specs(join=True))
def test_join_with_fewer_batches_equals_one_process_on_the_data_seen(rank_pools: RankPoolRegistry,
                                                                     example: tuple[int, dict]) -> None:
    world, spec = example
    results = rank_pools.get(world).run(train_uneven, spec)
    shortest = min(len(result["norms"]) for result in results)  # a joined rank clips no more itself
    for result in results:
        result["norms"], result["ref_norms"] = result["norms"][:shortest], result["ref_norms"][:shortest]
    check_equivalence(results)
    assert len({result["counters"] for result in results}) == 1, "progress counters differ after join()"


@pytest.mark.parametrize("stage", [0, 3])
def test_an_exception_inside_join_stops_the_other_ranks_at_once(rank_pools: RankPoolRegistry, stage: int) -> None:
    rank0, rank1 = rank_pools.get(2).run(raise_inside_join_on_rank1, stage)
    assert rank1["error"] == "ValueError"
    assert rank0["error"] == "CollectiveError" and "model.join()" in rank0["message"], rank0
    assert rank0["seconds"] < 20, rank0  # not the engine's collective timeout


def test_join_does_not_nest() -> None:
    from rank_pool import run_local
    (message,) = run_local(nested_join)
    assert "already active" in message


@pytest.mark.parametrize("stage", [0, 2])
def test_a_learning_rate_changed_on_one_rank_is_an_error_on_every_rank(rank_pools: RankPoolRegistry,
                                                                        stage: int) -> None:
    for result in rank_pools.get(2).run(lr_differs_on_rank1, stage):
        assert result["error"] and "hyperparameters" in result["error"] and "steps_taken" in result["error"]


@pytest.mark.parametrize("stage,compression", [(0, "int8"), (2, "bf16"), (3, {"grads": "int8", "params": "int8"})])
def test_join_serves_compressed_collectives(rank_pools: RankPoolRegistry, stage: int, compression) -> None:
    """A joined rank's zero-weight micro-steps go through the same (compressed) collectives."""
    spec = spec_with(3, [[[1, 2, 3]], [[2, 2, 2]], [[3, 1, 1]]], stage=stage, join=True, fewer=[2, 0, 1],
                     options={"compression": compression})
    results = rank_pools.get(3).run(train_uneven, spec)
    for result in results:
        assert result["finite"] and max(result["errors"].values()) < 0.05, result["errors"]
    for result in results[1:]:
        for key, tensor in results[0]["state"].items():
            assert result["state"][key].equal(tensor), key
