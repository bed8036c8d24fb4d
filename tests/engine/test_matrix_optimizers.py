"""Whole-tensor optimizers (Muon, Adafactor) and several optimizers at once, at every stage.

Each case trains the sharded model and a single-process reference on the global
batch (matrix_cases.py) and asserts the parameters agree. The cases are a
covering subset, not the cross product: every optimizer form (Muon alone,
Adafactor, the Muon + AdamW recipe, SGD + AdamW) meets every stage, every
world size N = 2, 3, 4 and hybrid sharding (``shard_group_size=2`` at N=4),
and each of accumulation, clipping, an optional branch some ranks skip (a
parameter unused in some steps), a frozen matrix and a tied embedding/head
appears with each optimizer form at least once.

[Note: Muon's tolerance]
torch's Muon runs Newton-Schulz in bf16. Where the reduced gradient differs
from the reference's in the last fp32 bit (summation order: accumulation and
N = 3, 4), a momentum element may round to a different bf16 value and the
update moves by up to one bf16 ulp (2**-7 relative) of that element's update,
which no sharding causes or can avoid (stage 0, DDP's semantics, shows the same:
N2-s0-muon_adamw-tied differs by 2.5e-4 on one CPU and not on another, as the
matmul kernels' summation order differs). The Muon cases therefore use a modest
learning rate (0.005 for the hidden matrices), and each Muon-stepped matrix's
bound is 2e-4 plus 2**-7 of its whole update (max |p - p0| / max |p|, measured
on the reference): the allowance scales with what Muon moved, so an engine error
of the size of a misplaced shard (a whole update) still fails. The owner step is
also checked against the engine's own stage 0.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_cases import base_spec_for, check_equivalence, rel_err
from matrix_cases import (checkpoint_then_continue, comm_of_step, fp16_overflow_momentum, full_optimizer_state_roundtrip,
                          meta_shapes_stage3, misuse_case, train_declared, train_matrix)
from rank_pool import RankPoolRegistry, run_local
from shardengine.flat.owner_layout import build_owner_layout


@pytest.fixture(scope="module", autouse=True)
def _prestart(rank_pools: RankPoolRegistry) -> None:
    rank_pools.prestart([2, 3, 4])


HYBRID = {"shard_group_size": 2}

# (world, stage, optimizer, spec overrides)
CASES = [
    (2, 1, "muon", dict(micro_steps=2, max_norm=0.5)),
    (3, 2, "muon", dict(tied=True, extra=True, extra_on=[[0], [1, 2], []])),
    (4, 3, "muon", dict(frozen=True, micro_steps=2)),
    (4, 2, "muon", dict(options=HYBRID, max_norm=0.5)),
    (2, 0, "muon", dict(max_norm=0.5)),  # stage 0: the user's Muon, as given
    (2, 3, "adafactor", dict(micro_steps=2, max_norm=0.5, tied=True)),
    (3, 1, "adafactor", dict(extra=True, extra_on=[[2], [], [0, 1]], frozen=True)),
    (4, 3, "adafactor", dict(options=HYBRID)),
    (4, 0, "adafactor", dict(micro_steps=2)),
    (2, 2, "adafactor", dict()),
    (2, 0, "muon_adamw", dict(tied=True)),
    (3, 3, "muon_adamw", dict(micro_steps=2, max_norm=0.5, tied=True, frozen=True)),
    (4, 1, "muon_adamw", dict(options=HYBRID, extra=True, extra_on=[[0, 3], [1], [2]])),
    (4, 2, "muon_adamw", dict(micro_steps=2)),
    (2, 1, "muon_adamw", dict(options={"offload_optimizer": True}, max_norm=0.5)),
    (2, 1, "sgd_adamw", dict(schedulers=True, max_norm=0.5)),
    (3, 0, "sgd_adamw", dict(schedulers=True)),
    (3, 2, "sgd_adamw", dict(micro_steps=2, tied=True)),
    (2, 3, "sgd_adamw", dict(schedulers=True, frozen=True, max_norm=0.5)),
]


def _spec(stage: int, optimizer: str, overrides: dict) -> dict:
    return base_spec_for(**{"stage": stage, "optimizer": optimizer, "steps": 3, "max_norm": None,
                            "per_rank_batch": 2, **overrides})


@pytest.mark.parametrize("world,stage,optimizer,overrides", CASES,
                         ids=[f"N{w}-s{s}-{o}-{'-'.join(sorted(k for k in ov if k != 'extra_on')) or 'plain'}"
                              for w, s, o, ov in CASES])
def test_matches_single_process(rank_pools: RankPoolRegistry, world: int, stage: int, optimizer: str,
                                overrides: dict) -> None:
    spec = _spec(stage, optimizer, overrides)
    results = rank_pools.get(world).run(train_matrix, spec)
    check_equivalence(results, tol=2e-4, extra_tol={key: 2.0 ** -7 * update
                                                    for key, update in results[0]["muon_updates"].items()})
    if stage >= 1 and optimizer != "sgd_adamw":
        _check_each_matrix_stepped_once_per_group(results)
    if spec.get("schedulers"):
        assert results[0]["lrs"][0] < 0.05 and results[0]["lrs"][-1] < 3e-3  # each scheduler ran


def _check_each_matrix_stepped_once_per_group(results: list[dict]) -> None:
    """Whole-tensor parameters: each on exactly one rank of every shard group."""
    size = results[0]["owners"]["group_size"]
    for first in range(0, len(results), size):
        group = results[first:first + size]
        stepped = [name for r in group for name in r["owners"]["stepped_here"]]
        assert len(stepped) == len(set(stepped)) and stepped, f"stepped more than once or not at all: {stepped}"
        assert sorted(stepped) == sorted(results[0]["owners"]["stepped_here"] + [
            n for r in results[1:size] for n in r["owners"]["stepped_here"]])


def test_owner_step_equals_replicated_step(rank_pools: RankPoolRegistry) -> None:
    """Stages 1-3 step each matrix on its owner only; the result is bit for bit what every
    rank computes at stage 0 (same reduced gradient, same Newton-Schulz). N = 2: a sum of two
    gradients is the same in any order, so the reduced gradients are identical."""
    pool = rank_pools.get(2)
    states = {stage: pool.run(train_matrix, _spec(stage, "muon", {}))[0]["state"] for stage in (0, 1, 3)}
    for stage in (1, 3):
        for key, value in states[0].items():
            assert torch.equal(states[stage][key], value), f"stage {stage}: {key} differs from stage 0"


@pytest.mark.parametrize("world,stage,options", [(3, 1, {}), (2, 2, {"collectives": "native"}), (3, 3, {}),
                                                (4, 2, HYBRID)])
def test_bytes_sent_are_the_ring_model_bytes(rank_pools: RankPoolRegistry, world: int, stage: int,
                                             options: dict) -> None:
    """Owner layouts pad buckets differently; the counters and ring_model_bytes() still agree."""
    spec = base_spec_for(optimizer="muon_adamw", stage=stage, per_rank_batch=2, options=options)
    for result in rank_pools.get(world).run(comm_of_step, spec):
        assert result["owner_buckets"] > 0
        assert result["sent"] == result["ring_model"] > 0


@pytest.mark.parametrize("world,stage", [(2, 2), (2, 0), (3, 3)])
def test_fp16_overflow_skips_step_and_keeps_momentum_finite(rank_pools: RankPoolRegistry, world: int,
                                                            stage: int) -> None:
    results = rank_pools.get(world).run(fp16_overflow_momentum, base_spec_for(stage=stage, per_rank_batch=2))
    assert sum(result["n_momenta"] for result in results) > 0  # N=3: a rank may own no matrix
    for result in results:
        assert result["finite"] and result["unchanged"], "an overflowing step touched Muon's momentum"
        assert result["scale_after"] < result["scale_before"]
        assert result["finite_after_next"] and result["params_finite"]


def test_meta_model_at_stage3_gives_muon_the_real_shapes(rank_pools: RankPoolRegistry) -> None:
    results = rank_pools.get(2).run(meta_shapes_stage3, base_spec_for(per_rank_batch=2))
    everything = sorted(s for r in results for s in r["shapes"])
    assert everything == sorted([(11, 3), (1000, 3), (3, 1000), (3, 3), (11, 3)])
    assert all(len(s) == 2 for r in results for s in r["stepped"]) and all(r["finite"] for r in results)


@pytest.mark.parametrize("optimizer", ["muon_adamw", "adafactor"])
def test_checkpoint_at_n2_stage3_continues_at_n3_stage1(rank_pools: RankPoolRegistry, optimizer: str) -> None:
    path = tempfile.mkdtemp(prefix="matrixopt_ckpt_")
    try:
        spec = base_spec_for(optimizer=optimizer, before=2, after=2, global_batch=12, path=path)
        rank_pools.get(2).run(checkpoint_then_continue, {**spec, "stage": 3, "mode": "save"})
        resumed = rank_pools.get(3).run(checkpoint_then_continue, {**spec, "stage": 1, "mode": "load"})
        straight = rank_pools.get(3).run(checkpoint_then_continue, {**spec, "stage": 1, "mode": "straight"})
    finally:
        shutil.rmtree(path, ignore_errors=True)
    for key, value in straight[0]["state"].items():
        assert rel_err(resumed[0]["state"][key], value) <= 2e-4, key


@pytest.mark.parametrize("world,stage,optimizer", [(2, 2, "muon_adamw"), (3, 3, "adafactor"), (2, 0, "muon_adamw")])
def test_full_optimizer_state_dict_is_torch_format_per_optimizer(rank_pools: RankPoolRegistry, world: int,
                                                                 stage: int, optimizer: str) -> None:
    results = rank_pools.get(world).run(full_optimizer_state_roundtrip,
                                        base_spec_for(optimizer=optimizer, stage=stage, per_rank_batch=2))
    first = results[0]
    assert first["is_list"] == (optimizer == "muon_adamw")
    for key, value in first["plain"].items():
        assert rel_err(first["state"][key], value) <= 2e-4, key


def test_declared_whole_tensor_optimizer(rank_pools: RankPoolRegistry) -> None:
    for stage in (1, 3):
        check_equivalence(rank_pools.get(3).run(train_declared, base_spec_for(stage=stage, steps=2,
                                                                               per_rank_batch=2)))


@pytest.mark.parametrize("case,expected", [
    ("overlap", "head.weight"),
    ("unknown_class", "whole_tensor_optimizers"),
    ("bad_declared", "whole_tensor_optimizers must be"),
    ("member_step", "call step() on the list"),
    ("list_add_group", "add_param_group() after shard()"),
    ("not_an_optimizer", "must be a torch.optim.Optimizer"),
])
def test_misuse_is_a_clear_config_error(case: str, expected: str) -> None:
    result = run_local(misuse_case, case)[0]
    assert result["is_config_error"], result
    assert expected in result["message"], result["message"]


@settings(max_examples=40)
@given(numels=st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=12),
       world=st.integers(min_value=1, max_value=8))
def test_owner_layout_keeps_parameters_whole_and_balanced(numels: list[int], world: int) -> None:
    layout = build_owner_layout([(n,) for n in numels], world)
    assert layout.padded_numel == layout.shard_numel * world
    covered = set()
    for index, (slot, owner) in enumerate(zip(layout.slots, layout.owners)):
        start, end = layout.owned_range(owner)
        assert start <= slot.offset and slot.end <= end, "a parameter leaves its owner's region"
        span = set(range(slot.offset, slot.end))
        assert not covered & span
        covered |= span
        assert [(f.slot, f.param_start, f.param_end) for f in layout.fragments(owner) if f.slot == index] \
            == [(index, 0, slot.numel)]
    padding = {i for a, b in layout.padding_spans() for i in range(a, b)}
    assert covered | padding == set(range(layout.padded_numel)) and not covered & padding
    loads = layout.loads()
    assert max(loads) - sum(loads) / world <= max(numels)  # the greedy bound
