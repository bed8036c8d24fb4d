"""``model.stream_weights()``: the receiver's weights equal ``full_state_dict()`` (cast) at stages 0-3,
N = 2 and 3, a merged LoRA equals peft's ``merge_and_unload()``, an NF4 base comes dequantized as
bitsandbytes dequantizes it, and every rank's extra peak stays within the promised bound (workers:
stream_cases.py)."""

from __future__ import annotations

import importlib.util

import pytest

import stream_cases as cases

CALL_S = 300

# Diagonal over stage x world x dtype x receivers x precision: each stage at both world sizes,
# each dtype / receiver set / precision at several stages.
CONFIGS = {
    2: [dict(stage=0, precision="bf16", dtype="bf16"),            # the compute copy, read in place
        dict(stage=1, precision="bf16", dtype="fp32"),            # the fp32 masters, gathered
        dict(stage=2, dtype=None, receivers=[0]),
        dict(stage=3, precision="bf16", dtype="bf16", receivers=[1]),
        dict(stage=3, dtype="fp32", overlap=False, cap_fraction=0.15),
        dict(stage=3, dtype="bf16", receivers=[1], options=dict(shard_group_size=1))],  # hybrid: replicas
    3: [dict(stage=0, dtype="fp32", receivers=[2]),
        dict(stage=1, precision="bf16", dtype="bf16", receivers=[0, 2]),
        dict(stage=2, precision="bf16", dtype="fp32"),
        dict(stage=3, precision="bf16", dtype=None),
        dict(stage=3, dtype="bf16", receivers=[1], cap_fraction=0.5)],
}


def _check(found: dict) -> None:
    config = found["config"]
    receivers = config.get("receivers", "all")
    assert found["receives"] == (receivers == "all" or found["rank"] in receivers), found
    if found["receives"]:
        assert found["equal"], found
        assert found["missing"] == []
        assert found["bytes"] == found["nbytes"]
    assert found["unchanged"], "streaming changed the trained model"
    assert found["buckets"] >= 3, "the cap should split this model into several buckets"
    assert found["bound"] >= found["cap"]
    assert found["peak"] <= found["bound"], (found["peak"], found["bound"], config, found["rank"])


@pytest.mark.parametrize("world", [2, 3])
def test_stream_equals_full_state_dict_within_the_cap(rank_pools, world) -> None:
    for per_rank in rank_pools.get(world).run(cases.stream_matches_full_state, CONFIGS[world], timeout=CALL_S):
        for found in per_rank:
            _check(found)
    # stages 0-2 streaming their compute dtype read the full copy in place: no collective
    assert not per_rank[0]["collective"] if CONFIGS[world][0]["stage"] == 0 else True


@pytest.mark.parametrize("world, stage", [(2, 3), (3, 1)])
def test_a_lora_model_streams_merged_as_merge_and_unload(rank_pools, world, stage) -> None:
    pytest.importorskip("peft")
    for result in rank_pools.get(world).run(cases.lora_stream_matches_merge_and_unload, stage, [None, "bf16"],
                                            timeout=CALL_S):
        assert result["moved"] > 1e-4, "the adapters did not train: the merge would add nothing"
        assert result["adapters_untouched"]
        for dtype in (None, "bf16"):
            found = result[dtype]
            assert found["names_equal"] and found["equal"], (dtype, found)
            assert found["peak"] <= found["bound"], (dtype, found)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
@pytest.mark.parametrize("kind, with_lora", [("nf4", False), ("nf4", True), ("int8", False)])
def test_a_quantized_base_streams_dequantized_at_stage_3(rank_pools, base_folder, kind, with_lora) -> None:
    for found in rank_pools.get(2).run(cases.nf4_stream_matches_dequantized, base_folder, with_lora, kind,
                                       timeout=CALL_S):
        assert found["names"] and found["equal"], found
        assert found["collective"]
        assert found["peak"] <= found["bound"], found
