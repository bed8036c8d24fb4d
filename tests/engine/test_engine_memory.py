"""``memory_report()`` shrinks exactly as the ZeRO formulas say (fp32: params and grads 4 bytes).

With Ψ trainable parameters packed into flat buckets padded to a multiple of N
(Σpadded = sum of the buckets' ``layout.padded_numel``) and K bytes of
optimizer state per parameter (Adam 8, SGD with momentum 4, plain SGD 0):

| stage | params          | grads           | optimizer states |
|-------|-----------------|-----------------|------------------|
| 0     | 4·Σpadded       | 4·Σpadded       | K·Ψ (on the original parameters) |
| 1     | 4·Σpadded       | 4·Σpadded       | K·owned          |
| 2     | 4·Σpadded       | 4·Σpadded/N     | K·owned          |
| 3     | 4·Σpadded/N     | 4·Σpadded/N     | K·owned          |

``owned`` is the real (unpadded) elements of this rank's slices, at most
Σpadded/N: the optimizer keeps one state tensor per parameter fragment, so
padding has no state. Frozen parameters have no gradient and no optimizer
state; at stages 0-2 they are held whole (4 bytes each), at stage 3 they are
sharded with the rest.

Hybrid sharding (``shard_group_size=k``) is the same table with N -> k: the
buckets are laid out, padded and sharded over the k ranks of a group.
"""

from __future__ import annotations

import pytest

from engine_cases import memory_after_step
from rank_pool import RankPoolRegistry, run_local

pytestmark = pytest.mark.prestart(2, 4)  # start-ups overlap (conftest.py)


STATE_BYTES = {"adam": 8, "sgd_momentum": 4, "sgd": 0}


def spec(stage: int, optimizer: str, frozen: bool, **options) -> dict:
    # bucket_mb=0.0005 (131 floats) splits the model into several buckets at stages 0-2.
    return dict(seed=0, vocab=11, dim=7, hidden=[5, 13], frozen=frozen, stage=stage,
                optimizer=optimizer, per_rank_batch=3, bucket_mb=0.0005, options=options)


def expected_report(result: dict, stage: int, optimizer: str) -> dict:
    n, k = result["group"], STATE_BYTES[optimizer]  # N, or the shard group's k under hybrid sharding
    psi, frozen = result["trainable"], result["frozen"]
    padded, padded_all = result["padded_grad"], result["padded_all"]
    params = 4 * padded_all // n if stage == 3 else 4 * padded + 4 * frozen
    grads = 4 * padded // n if stage >= 2 else 4 * padded
    states = k * psi if stage == 0 else k * result["owned_grad"]
    assert stage == 0 or result["owned_grad"] <= padded // n
    return {"params": params, "grads": grads, "optimizer_states": states}


def check(results: list[dict], stage: int, optimizer: str) -> None:
    for rank, result in enumerate(results):
        report = result["report"]
        got = {"params": report.params, "grads": report.grads,
               "optimizer_states": report.optimizer_states}
        assert got == expected_report(result, stage, optimizer), f"rank {rank}"
        assert report.comm_buffers == 0, f"rank {rank}: transient buffers left after the step"
        assert result["report_after_zero_grad"].comm_buffers == 0
        if stage >= 2:
            assert report.peak_comm_buffers > 0, f"rank {rank}: peak of transient buffers not tracked"
        elif stage == 1:  # Gloo reduces into the persistent gradient's own slice (comm.reduces_in_place)
            assert report.peak_comm_buffers == 0, f"rank {rank}: stage 1 allocated a reduction buffer"
    assert len({(r["report"].params, r["report"].grads) for r in results}) == 1, \
        "ranks report different parameter or gradient bytes"


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "frozen-block"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum", "sgd"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_matches_zero_formulas(rank_pools: RankPoolRegistry, stage: int, world: int,
                                             optimizer: str, frozen: bool) -> None:
    results = rank_pools.get(world).run(memory_after_step, spec(stage, optimizer, frozen))
    result = results[0]
    assert result["padded_grad"] % world == 0 and result["padded_all"] % world == 0
    if stage < 3:
        assert result["n_buckets"] > 1, "the test model should span several buckets"
    check(results, stage, optimizer)


def test_model_has_padding_so_the_formulas_are_not_trivial(rank_pools: RankPoolRegistry) -> None:
    (result, *_) = rank_pools.get(4).run(memory_after_step, spec(1, "adam", False))
    assert result["padded_grad"] > result["trainable"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_one_holds_everything(stage: int) -> None:
    (result,) = run_local(memory_after_step, spec(stage, "adam", True))
    assert result["padded_grad"] == result["trainable"]  # N = 1: no padding
    check([result], stage, "adam")


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "frozen-block"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_memory_is_the_formula_with_n_to_k(rank_pools: RankPoolRegistry, stage: int, frozen: bool) -> None:
    """4 ranks in groups of 2 hold what 2 ranks of plain sharding hold, byte for byte."""
    hybrid = rank_pools.get(4).run(memory_after_step, spec(stage, "adam", frozen, shard_group_size=2))
    assert hybrid[0]["group"] == 2 and hybrid[0]["padded_grad"] % 2 == 0
    check(hybrid, stage, "adam")
    plain = rank_pools.get(2).run(memory_after_step, spec(stage, "adam", frozen))
    for rank, result in enumerate(hybrid):
        # activation bytes aside: each rank's input is a slice of the global batch, whose storage
        # (and so what autograd's saved indices hold) grows with N
        assert _states(result["report"]) == _states(plain[rank % 2]["report"]), f"rank {rank}"


def _states(report) -> dict[str, int]:
    return {k: v for k, v in report.as_dict().items() if "activations" not in k}


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "frozen-block"])
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_mixed_precision_keeps_no_bf16_shard_beside_the_master(rank_pools: RankPoolRegistry, world: int,
                                                                      frozen: bool) -> None:
    """bf16 compute, fp32 masters, Adam: between steps a rank holds its fp32 master slice and
    Adam's two moments (4·Σpadded/N + 8·owned: FSDP2's 12Ψ/N) and no bf16 copy of the slice;
    frozen parameters have no master, so their bf16 slice is what is kept of them."""
    case = {**spec(3, "adam", frozen, param_dtype="bf16"), "buffer": False}  # no fp32 buffer meeting bf16
    results = rank_pools.get(world).run(memory_after_step, case)
    for rank, result in enumerate(results):
        after = result["report_after_zero_grad"]
        frozen_shard = (result["padded_all"] - result["padded_grad"]) // world
        assert after.params == 2 * frozen_shard, f"rank {rank}"
        assert after.grads == 0, f"rank {rank}"
        assert after.optimizer_states == 4 * result["padded_grad"] // world + 8 * result["owned_grad"], f"rank {rank}"
