"""ShardFabricStrategy under lightning.fabric.Fabric against Fabric's DDPStrategy, 2 Gloo ranks
(workers: fabric_cases.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import fabric_cases as cases  # noqa: E402

TOL = 2e-4
CALL_S = 600


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fabric_loop_with_accumulation_and_clipping_equals_fabric_ddp(rank_pools, tmp_path, stage: int) -> None:
    first, second = rank_pools.get(2).run(cases.fabric_equals_ddp, stage, str(tmp_path), timeout=CALL_S)
    assert max(first["errors"].values()) <= TOL, first["errors"]
    assert first["moved"] > 1e-3, "training did not change the parameters: the comparison would be vacuous"
    for result in (first, second):
        assert result["norms"] == pytest.approx(result["ddp_norms"], rel=1e-5)
        assert result["iter_num"] == cases.STEPS       # fabric.load restored the plain entries in place
    assert first["resumed_equal"]                      # saved sharded, loaded at another stage


def test_bf16_mixed_is_the_engines_param_dtype_and_refusals_are_clear(rank_pools) -> None:
    for found in rank_pools.get(2).run(cases.precision_and_refusals, timeout=CALL_S):
        assert found["param_dtype"] in ("bf16", "torch.bfloat16"), found["param_dtype"]
        assert found["compute_dtype"] == "torch.bfloat16"
        assert "use max_norm=" in found["clip_value"]
        assert "norm_type=1 is not supported" in found["norm_type"]
        assert "does not support precision='bf16-true'" in found["bf16_true"]
        assert "set one of them" in found["dtype_conflict"]
        assert "unknown option(s) ['bucket_size']" in found["option"]
        assert "call fabric.setup(model, optimizer)" in found["setup_optimizers"]
        assert "with one optimizer; fabric.setup got 2" in found["two_optimizers"]
