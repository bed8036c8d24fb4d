"""``shard(compression=...)``: bytes against the formulas, training against uncompressed, refusals.

Bytes per rank and step, for a bucket of P padded elements over N ranks, c = P/N,
each message m = 2c (bf16/fp16) or c + 4*ceil(c/B) (int8, blocks of B, fp32 scales):
the gradient reduce-scatter is one all-to-all sending (N-1) m; stage 0 adds an
all-gather of the owners' sums, (N-1) m (as N broadcasts of m on Gloo's in-place
primitives); stage 3's int8 parameter gathers send (N-1) m twice per micro-step.
PowerSGD sends three ring all-reduces per bucket: the P factors (short side x r),
the Q factors (long side x r) and the uncompressed rest, in fp32.
"""

from __future__ import annotations

import math

import pytest

import compression_cases as cases
from engine_cases import comm_bytes_of_step
from rank_pool import RankPoolRegistry
from shardengine.config import ShardConfig
from shardengine.policies import Compression, parse_compression
from shardengine.errors import ConfigError
from test_engine_comm import control_bytes, nonzero, ring, spec


def message_bytes(chunk: int, wire: str, block: int = 256) -> int:
    return 2 * chunk if wire in ("bf16", "fp16") else chunk + 4 * math.ceil(chunk / block)


def gathered(messages: list[int], world: int, collectives: str) -> dict:
    """An all-gather of one message per rank, as the communicator issues it."""
    if collectives == "auto":
        return {"broadcast": sum(world * ring(1, m, world) for m in messages)}
    return {"all_gather": sum((world - 1) * m for m in messages)}


def powersgd_bytes(shapes: list[tuple], rank: int, world: int, min_rate: float = 2.0) -> int:
    p = q = dense = 0
    for shape in shapes:
        size = math.prod(shape)
        if len(shape) >= 2 and size:
            short, long = sorted((shape[0], size // shape[0]))
            r = min(rank, short)
            if (short + long) * r * min_rate < short * long:
                p, q = p + short * r, q + long * r
                continue
        dense += size
    return sum(ring(2, 4 * n, world) for n in (p, q, dense))


def expected(stage: int, compression: dict, result: dict, world: int, collectives: str) -> dict:
    grads = compression.get("grads")
    padded = [(nbytes // 4, requires_grad) for nbytes, requires_grad in result["buckets"]]  # fp32 model
    chunks = [p // world for p, requires_grad in padded if requires_grad]
    out: dict = {}
    if grads == "powersgd":
        out["all_reduce"] = sum(powersgd_bytes(shapes, compression.get("powersgd_rank", 4), world)
                                for shapes in result["bucket_shapes"])
    elif grads:
        messages = [message_bytes(c, grads) for c in chunks]
        out["all_to_all"] = sum((world - 1) * m for m in messages)
        if stage == 0:
            out.update(gathered(messages, world, collectives))
    else:
        out["all_reduce" if collectives == "auto" else "reduce_scatter"] = sum(
            ring(2 if collectives == "auto" else 1, 4 * p, world) for p, grad in padded if grad)
    if stage in (1, 2):  # the exact parameter all-gather after the step
        exact = [4 * p // world for p, _ in padded]
        out.update({k: out.get(k, 0) + v for k, v in gathered(exact, world, collectives).items()})
    if stage == 3:
        messages = [message_bytes(p // world, compression["params"]) if compression.get("params")
                    else 4 * p // world for p, _ in padded]
        for kind, count in gathered(messages, world, collectives).items():
            out[kind] = out.get(kind, 0) + 2 * count
    return out


BYTE_CASES = [(0, {"grads": "bf16"}), (0, {"grads": "int8"}), (0, {"grads": "powersgd", "powersgd_rank": 1}),
              (1, {"grads": "int8"}), (2, {"grads": "fp16"}), (2, {"grads": "int8"}),
              (3, {"grads": "int8", "params": "int8"}), (3, {"params": "int8"}), (3, {"grads": "bf16"})]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage,compression", BYTE_CASES, ids=[f"s{s}-{'-'.join(map(str, c.values()))}"
                                                               for s, c in BYTE_CASES])
def test_counters_equal_the_compressed_formulas(rank_pools: RankPoolRegistry, stage: int, compression: dict,
                                                world: int) -> None:
    collectives = "auto" if world == 2 else "native"  # Gloo's in-place all-gather at N=2, textbook at 3
    case = dict(spec(stage, collectives=collectives), options={"compression": compression})
    for rank, result in enumerate(rank_pools.get(world).run(comm_bytes_of_step, case)):
        want = {**expected(stage, compression, result, world, collectives), **control_bytes(result, world)}
        assert nonzero(result["bytes"]) == nonzero(want), f"rank {rank}"
        assert sum(result["bytes"].values()) == result["ring_model"], "ring_model_bytes() disagrees"
        assert result["ring_model_by_group"]["total"] == result["ring_model"]


# --------------------------------------------------------------------------- training


SPEC = dict(seed=0, vocab=11, dim=7, hidden=[5, 13], per_rank_batch=4, bucket_mb=0.0005)


def _check_ranks_agree(results: list[dict]) -> None:
    import torch
    for rank, result in enumerate(results[1:], start=1):
        for key, tensor in results[0]["state"].items():
            assert torch.equal(result["state"][key], tensor), f"rank {rank} disagrees on {key}: replicas diverged"


@pytest.mark.parametrize("stage,wire", [(0, "bf16"), (2, "bf16"), (2, "fp16")])
def test_low_precision_reduction_stays_close_to_fp32(rank_pools: RankPoolRegistry, stage: int, wire: str) -> None:
    """Each value rounded once to bf16 (8 bits of mantissa: relative error 2^-9 per gradient
    value) moves the parameters after 10 SGD steps by well under 1% of their size."""
    results = rank_pools.get(2).run(cases.compare_with_uncompressed, {**SPEC, "stage": stage}, wire, 10)
    _check_ranks_agree(results)
    worst = max(results[0]["errors"].values())
    assert results[0]["finite"] and worst < 5e-3, results[0]["errors"]
    assert abs(results[0]["losses"][-1] - results[0]["exact_losses"][-1]) < 1e-3 * results[0]["exact_losses"][-1]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_int8_with_error_feedback_tracks_uncompressed_training(rank_pools: RankPoolRegistry, stage: int) -> None:
    """20 steps with blocks of 16 (coarse on purpose): the parameters stay within 1% of the
    uncompressed run's and the loss curve within 0.5%; all ranks hold the same values."""
    compression = {"grads": "int8", "block_size": 16, **({"params": "int8"} if stage == 3 else {})}
    results = rank_pools.get(2).run(cases.compare_with_uncompressed, {**SPEC, "stage": stage}, compression, 20)
    _check_ranks_agree(results)
    result = results[0]
    assert result["finite"] and max(result["errors"].values()) < 1e-2, result["errors"]
    for got, want in zip(result["losses"], result["exact_losses"]):
        assert abs(got - want) < 5e-3 * want


def test_int8_with_fp16_loss_scaling_tracks_uncompressed_training(rank_pools: RankPoolRegistry) -> None:
    """fp16 compute, dynamic loss scale: the residuals are in scaled units and follow the scale."""
    spec = {**SPEC, "stage": 2, "buffer": False, "options": {"param_dtype": "fp16"}}  # no fp32 buffer
    result = rank_pools.get(2).run(cases.compare_with_uncompressed, spec, "int8", 10)[0]
    assert result["finite"] and max(result["errors"].values()) < 1e-2, result["errors"]


def test_residuals_follow_the_loss_scale() -> None:
    """A residual kept under loss scale 1024 is worth half as many units under 512."""
    import torch
    from shardengine.distributed.communicator import Communicator
    from shardengine.distributed.compression.collectives import CompressedCollectives
    from shardengine.flat.bucket import FlatBucket
    from shardengine.distributed.hybrid import HybridCommunicator
    scale = [1024.0]
    bucket = FlatBucket([torch.nn.Parameter(torch.zeros(4))], 0, 0, 1, torch.device("cpu"))
    bucket.alloc_full_grad()
    collectives = CompressedCollectives(Compression(grads="int8"), HybridCommunicator.create(Communicator.local(), 1),
                                        False, [bucket], lambda: scale[0])
    collectives.feedback_for(bucket).residual.fill_(2.0)
    scale[0] = 512.0
    assert collectives.feedback_for(bucket).residual.tolist() == [1.0] * 4


def test_powersgd_at_full_rank_is_exact(rank_pools: RankPoolRegistry) -> None:
    """Rank >= every matrix's short side and every matrix compressed (rate 0): P^ is orthogonal,
    so P^ P^T M = M and the reduction is exact up to fp32 rounding of the QR."""
    compression = {"grads": "powersgd", "powersgd_rank": 64, "powersgd_min_compression_rate": 0.0}
    results = rank_pools.get(2).run(cases.compare_with_uncompressed, {**SPEC, "stage": 0}, compression, 5)
    _check_ranks_agree(results)
    assert max(results[0]["errors"].values()) < 1e-5, results[0]["errors"]


def test_powersgd_low_rank_tracks_uncompressed_training(rank_pools: RankPoolRegistry) -> None:
    """Rank 1 is lossy, error feedback makes up for it over steps: after 20 steps the loss curve
    stays within 1% of the exact run's; replicas stay identical (all apply the same P^ Q^T)."""
    results = rank_pools.get(2).run(cases.compare_with_uncompressed, {**SPEC, "stage": 0},
                                    {"grads": "powersgd", "powersgd_rank": 1}, 20)
    _check_ranks_agree(results)
    result = results[0]
    assert result["finite"] and max(result["errors"].values()) < 0.2, result["errors"]
    for got, want in zip(result["losses"], result["exact_losses"]):
        assert abs(got - want) < 1e-2 * want


def test_int8_parameter_gathers_keep_the_masters_exact(rank_pools: RankPoolRegistry) -> None:
    results = rank_pools.get(2).run(cases.stage3_int8_params_keep_masters_exact, {**SPEC, "stage": 3})
    for result in results:
        assert result["masters_exact"], "the sharded parameters must never be quantized"
        assert 0 < result["output_diff"] < 0.05 * result["output_scale"]
    import torch
    assert torch.equal(results[0]["output"], results[1]["output"]), "ranks computed with different weights"


@pytest.mark.parametrize("compression", ["int8", {"grads": "powersgd", "powersgd_rank": 1}])
def test_carried_state_is_checkpointed(rank_pools: RankPoolRegistry, tmp_path, compression) -> None:
    """Residuals (int8) and PowerSGD's errors and Q's come back from a checkpoint; a checkpoint
    saved with another compression restarts them from zero, with a warning."""
    import torch
    results = rank_pools.get(2).run(cases.residual_round_trip, {**SPEC, "stage": 0}, str(tmp_path), compression)
    for result in results:
        saved, loaded = result["saved"], result["loaded"]
        assert result["state_bytes"] > 0 and result["reset_warned"]
        for key in ("feedback", "owner_feedback"):
            assert saved[key].keys() == loaded[key].keys()
            assert all(torch.equal(saved[key][i], loaded[key][i]) for i in saved[key])
        for index, state in saved["powersgd"].items():
            for part in ("errors", "q"):
                assert state[part].keys() == loaded["powersgd"][index][part].keys() and state[part]
                assert all(torch.equal(t, loaded["powersgd"][index][part][i]) for i, t in state[part].items())
    saved = results[0]["saved"]
    assert any(bool(r.abs().sum() > 0) for r in saved["feedback"].values()) or saved["powersgd"], \
        "nothing was carried: the round trip checked nothing"


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("options,phrase", [
    (dict(stage=1, compression="powersgd"), "needs stage 0"),
    (dict(stage=3, compression={"grads": "powersgd"}), "needs stage 0"),
    (dict(stage=2, compression={"params": "int8"}), "needs stage 3"),
    (dict(stage=0, compression={"params": "int8"}), "needs stage 3"),
    (dict(compression="zstd"), "must be one of"),
    (dict(compression={"grads": "int4"}), "must be one of"),
    (dict(compression={"params": "bf16"}), "must be one of"),
    (dict(compression={"grad": "int8"}), "unknown compression key"),
    (dict(compression={"grads": "int8", "block_size": 0}), "block_size"),
    (dict(compression={"grads": "powersgd", "powersgd_rank": 0}), "powersgd_rank"),
    (dict(compression=["int8"]), "compression must be"),
    (dict(stage=2, param_dtype="bf16", compression="bf16"), "already reduced in bfloat16"),
    (dict(stage=0, param_dtype="fp16", compression="powersgd"), "fp16"),
])
def test_impossible_combinations_are_refused(options: dict, phrase: str) -> None:
    with pytest.raises(ConfigError, match=phrase):
        ShardConfig(**options)


def test_option_forms() -> None:
    assert parse_compression(None) is None and parse_compression({}) is None
    assert parse_compression("INT8") == Compression(grads="int8")
    assert ShardConfig(stage=3, compression={"grads": "bf16", "params": "int8"}).compression == \
        Compression(grads="bf16", params="int8")
    assert ShardConfig(stage=2, param_dtype="bf16", reduce_dtype="fp32", compression="bf16").compression.grads == "bf16"


@pytest.mark.parametrize("options,stage,phrase", [
    (dict(compression="int8", shard_group_size=1), 2, "hybrid sharding"),
    (dict(compression="powersgd"), "auto", "stage='auto'"),
])
def test_refusals_that_need_the_world(rank_pools: RankPoolRegistry, options: dict, stage, phrase: str) -> None:
    for message in rank_pools.get(2).run(cases.shard_error, options, stage):
        assert phrase in message, message


def test_hybrid_sharding_with_int8_parameters_only_is_fine(rank_pools: RankPoolRegistry) -> None:
    assert rank_pools.get(2).run(cases.shard_error, dict(compression={"params": "int8"}, shard_group_size=1),
                                 3) == ["", ""]
