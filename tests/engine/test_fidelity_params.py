"""Parameters as users touch them between steps (issue: drop-in fidelity, items 1, 9, 10).

At stages 0-2 every idiom behaves as on the unwrapped model. At stage 3 a rank
holds only slices between steps, so anything that reads element data raises a
clear ``ShardedAccessError`` naming ``summon_full_params`` — never freed memory,
never a crash — while metadata (shapes, parameter counts) stays right.
``state_dict()`` round-trips through ``torch.save``/``torch.load`` into the
unwrapped model at every stage; mixed precision saves the fp32 masters.
"""

from __future__ import annotations

import pytest

from engine_cases import base_spec_for
from fidelity_cases import full_values_under_mixed_precision, idioms_between_steps, moved_after_shard
from rank_pool import RankPoolRegistry

DATA_IDIOMS = ["print", "sum", "detach_clone", "numpy", "data", "parameters_to_vector", "save_param",
               "module_state_dict", "deepcopy_model", "deepcopy_module", "sum_by_keyword", "init_by_keyword"]


pytestmark = pytest.mark.prestart(2, 3)  # start-ups overlap (conftest.py)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameter_idioms_between_steps(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    spec = base_spec_for(stage=stage, tied=True, bucket_mb=0.0005)
    for rank, result in enumerate(rank_pools.get(world).run(idioms_between_steps, spec)):
        where = f"stage {stage}, rank {rank}"
        for idiom in DATA_IDIOMS:
            if stage == 3:
                assert result[idiom].startswith("ShardedAccessError"), (where, idiom, result[idiom])
                assert "summon_full_params" in result[idiom], (where, idiom)
            else:
                assert result[idiom] == "ok", (where, idiom, result[idiom])
        for cast in ("to_float64", "double"):
            assert result[cast].startswith("ConfigError") and "before shard()" in result[cast], (where, cast)
        assert result["to_same_device"] == result["cpu_same_device"] == result["float_same_dtype"] == "ok"
        assert result["shape"] == (5, 7)  # metadata stays the full parameter's
        assert result["state_dict_round_trip"] == 0.0, where
        assert result["summoned"] == 0.0 and result["ema_values"] == 0.0, where
        assert result["ema_type"] == "Net" and result["ema_forward"] == "ok", where
        assert result["writeback"] < 1e-6, where
        assert result["trains_after"] == "ok", where
    counts = {r["count_params"] for r in rank_pools.get(world).run(idioms_between_steps, spec)}
    assert len(counts) == 1  # sum(p.numel()) is the full model's count on every rank


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_saves_fp32_masters(rank_pools: RankPoolRegistry, stage: int) -> None:
    for result in rank_pools.get(2).run(full_values_under_mixed_precision, base_spec_for(stage=stage)):
        assert result["dtype"] == "torch.float32" and result["compute_dtype"] == "torch.bfloat16"
        assert result["not_bf16_representable"], "full_state_dict() returned rounded values"
        assert result["compute_is_rounded_master"]
        assert result["state_dict_equal"] and result["summoned_equal"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_casting_the_module_behind_the_engine_is_caught(rank_pools: RankPoolRegistry, stage: int) -> None:
    for result in rank_pools.get(2).run(moved_after_shard, base_spec_for(stage=stage)):
        if stage == 3:  # the cast itself reads the sharded parameters
            assert result["module_double"].startswith("ShardedAccessError")
        else:
            assert result["module_double"] == "ok"
            assert result["next_forward"].startswith("ConfigError"), result["next_forward"]
            assert "before shard()" in result["next_forward"]
