"""Bytes sent per step match the ring model (ARCHITECTURE.md §2), exactly.

S = bytes of one full (padded) gradient copy. Per rank and step:
stage 0 all-reduces 2(N-1)/N·S; stages 1-2 reduce-scatter (N-1)/N·S and
all-gather (N-1)/N·S; stage 3 reduce-scatters (N-1)/N·S and all-gathers
2(N-1)/N·S (forward and backward). The counter rounds per collective
(``factor*(N-1)*bytes//N``), so the expectation is summed per bucket the same way.
No clipping here: its scalar all-reduce is not part of the model.

Two small collectives ride along (both in ``ring_model_bytes``): the step's
agreement all-reduce ("step_sync": float64, a short header and one flag per
trainable parameter, see step/agreement.py) and the
broadcast of rank 0's buffers after every backward ("buffers", DDP's broadcast_buffers).

With ``collectives="auto"`` on Gloo (see distributed/communicator.py's note on Gloo's in-place
primitives) each reduce-scatter goes out as an all-reduce and is counted as one,
2(N-1)/N·S instead of (N-1)/N·S, and each all-gather as one broadcast of every
rank's chunk: the same (N-1)/N·S in all, counted chunk by chunk.
"""

from __future__ import annotations

import pytest

from engine_cases import comm_bytes_of_step
from shardengine.step.agreement import vector_bytes
from rank_pool import RankPoolRegistry, run_local


pytestmark = pytest.mark.prestart(1, 2, 3, 4)  # start-ups overlap (conftest.py)


IMPLEMENTATIONS = ["native", "auto"]  # auto on Gloo: the in-place primitives


def spec(stage: int, micro_steps: int = 1, bucket_mb: float = 0.0005, collectives: str = "native") -> dict:
    return dict(seed=0, vocab=11, dim=7, hidden=[5, 13], stage=stage, per_rank_batch=2,
                micro_steps=micro_steps, bucket_mb=bucket_mb, collectives=collectives)


def ring(factor: int, nbytes: int, world: int) -> int:
    return factor * (world - 1) * nbytes // world


def expected_bytes(stage: int, buckets: list[tuple[int, bool]], world: int, micro_steps: int = 1,
                   collectives: str = "native") -> dict:
    """Per kind, for one optimizer step of ``micro_steps`` micro-steps (no_sync on all but the last)."""
    in_place = collectives == "auto"
    grads = [nbytes for nbytes, requires_grad in buckets if requires_grad]
    everything = [nbytes for nbytes, _ in buckets]

    def reduce_scatter(sizes):
        return ("all_reduce", sum(ring(2, b, world) for b in sizes)) if in_place else \
            ("reduce_scatter", sum(ring(1, b, world) for b in sizes))

    def all_gather(sizes):  # in place: one broadcast per rank's chunk (b is a multiple of N)
        return ("broadcast", sum(world * ring(1, b // world, world) for b in sizes)) if in_place else \
            ("all_gather", sum(ring(1, b, world) for b in sizes))

    if stage == 0:
        return {"all_reduce": sum(ring(2, b, world) for b in grads)}
    (rs_kind, reduced), (ag_kind, gathered) = reduce_scatter(grads), all_gather(grads)
    if stage == 1:
        expected = {rs_kind: reduced, ag_kind: gathered}
    elif stage == 2:  # reduce-scatters every micro-step, even under no_sync (see ShardedModel.no_sync)
        expected = {rs_kind: micro_steps * reduced, ag_kind: gathered}
    else:
        expected = {rs_kind: micro_steps * reduced, ag_kind: micro_steps * 2 * all_gather(everything)[1]}
    return {kind: count for kind, count in expected.items() if count}


def control_bytes(result: dict, world: int, micro_steps: int = 1) -> dict:
    """The step-sync all-reduce and the buffer broadcasts (one dtype here: one broadcast)."""
    return {"step_sync": ring(2, vector_bytes(result["trainable_params"]), world),
            "buffers": micro_steps * ring(1, sum(result["buffer_bytes"]), world)}


def nonzero(counts: dict) -> dict:
    return {kind: count for kind, count in counts.items() if count}


@pytest.mark.parametrize("collectives", IMPLEMENTATIONS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_step_sends_the_ring_model_bytes(rank_pools: RankPoolRegistry, stage: int, world: int,
                                             collectives: str) -> None:
    results = rank_pools.get(world).run(comm_bytes_of_step, spec(stage, collectives=collectives))
    for rank, result in enumerate(results):
        assert nonzero(result["bytes"]) == {**expected_bytes(stage, result["buckets"], world, collectives=collectives),
                                            **control_bytes(result, world)}, f"rank {rank}"
        assert sum(result["bytes"].values()) == result["ring_model"], "ring_model_bytes() disagrees"
    # In the ring model's own terms: S = one full gradient copy; textbook ZeRO moves 2S
    # (stages 0-2) or 3S (stage 3) times (N-1)/N, Gloo's all-reduce-for-reduce-scatter one S more.
    full = sum(nbytes for nbytes, _ in results[0]["buckets"])
    factor = (3 if stage == 3 else 2) + (collectives == "auto" and stage > 0)
    total = sum(results[0]["bytes"].values()) - sum(control_bytes(results[0], world).values())
    assert abs(total - factor * (world - 1) * full / world) <= len(results[0]["buckets"]) * factor * world
    if stage < 3:
        assert len(results[0]["buckets"]) > 1, "the test model should span several buckets"


@pytest.mark.parametrize("collectives", IMPLEMENTATIONS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_micro_steps(rank_pools: RankPoolRegistry, stage: int, collectives: str) -> None:
    world, micro_steps = 2, 3
    results = rank_pools.get(world).run(
        comm_bytes_of_step, spec(stage, micro_steps=micro_steps, collectives=collectives))
    for result in results:
        if stage <= 1:  # DDP convention: no gradient is sent until the synchronizing micro-step
            assert set(nonzero(result["in_no_sync"])) <= {"buffers"}, result["in_no_sync"]
        assert nonzero(result["bytes"]) == {**expected_bytes(stage, result["buckets"], world, micro_steps,
                                                             collectives),
                                            **control_bytes(result, world, micro_steps)}
        assert sum(result["bytes"].values()) == result["ring_model"], "ring_model_bytes() disagrees"


OPTION_CASES = [(stage, options) for stage in (1, 2, 3)
                for options in (dict(param_dtype="bf16"), dict(param_dtype="bf16", reduce_dtype="fp32"))]
OPTION_CASES.append((3, dict(reshard_after_forward=False)))


@pytest.mark.parametrize("collectives", IMPLEMENTATIONS)
@pytest.mark.parametrize("stage,options", OPTION_CASES, ids=[f"{s}-{'-'.join(map(str, o.values()))}"
                                                             for s, o in OPTION_CASES])
def test_ring_model_bytes_follows_dtypes_and_options(rank_pools: RankPoolRegistry, stage: int, options: dict,
                                                     collectives: str) -> None:
    """``ring_model_bytes()`` is what the counters record, whatever the buffers' dtypes."""
    # No fp32 buffer in the model: it would promote the bf16 activations back to fp32.
    case = dict(spec(stage, micro_steps=2, collectives=collectives), options=options, buffer=False)
    for result in rank_pools.get(3).run(comm_bytes_of_step, case):
        assert sum(result["bytes"].values()) == result["ring_model"] > 0


def test_auto_uses_in_place_primitives_on_gloo_only(rank_pools: RankPoolRegistry) -> None:
    from shardengine.distributed.traffic import uses_in_place_primitives
    results = rank_pools.get(2).run(comm_bytes_of_step, spec(2, collectives="auto"))
    assert all(result["in_place_primitives"] for result in results)
    assert not uses_in_place_primitives("auto", "nccl")
    assert not uses_in_place_primitives("native", "gloo")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_one_sends_nothing(rank_pools: RankPoolRegistry, stage: int) -> None:
    for result in run_local(comm_bytes_of_step, spec(stage)) + rank_pools.get(1).run(comm_bytes_of_step, spec(stage)):
        assert sum(result["bytes"].values()) == 0, result["bytes"]


# --------------------------------------------------------------------------- hybrid sharding


def expected_by_group(stage: int, result: dict, micro_steps: int, collectives: str) -> dict:
    """Hybrid sharding, N ranks in groups of k: the plain formulas with N -> k inside the group;
    across the N/k groups one all-reduce of each reduced shard (S/k) per reduction; the step's
    agreement and the buffers over all N ranks."""
    n, k = result["world"], result["group"]
    groups = n // k
    grads = [nbytes for nbytes, requires_grad in result["buckets"] if requires_grad]
    reductions = micro_steps if stage >= 2 else 1
    across = sum(ring(2, b // k, groups) for b in grads)
    return {"intra_group": expected_bytes(stage, result["buckets"], k, micro_steps, collectives),
            "inter_group": {"all_reduce": reductions * across} if across else {},
            "all_ranks": control_bytes(result, n, micro_steps)}


@pytest.mark.parametrize("collectives", IMPLEMENTATIONS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_sends_the_ring_model_bytes_per_group(rank_pools: RankPoolRegistry, stage: int,
                                                              collectives: str) -> None:
    """N = 4 in 2 groups of 2: per group exactly as above; ``bytes_by_kind`` stays the sum of the
    groups, and ``ring_model_bytes_by_group`` says the same per group."""
    micro_steps = 2
    case = dict(spec(stage, micro_steps=micro_steps, collectives=collectives), options={"shard_group_size": 2})
    for rank, result in enumerate(rank_pools.get(4).run(comm_bytes_of_step, case)):
        assert result["group"] == 2
        got = {name: nonzero(kinds) for name, kinds in result["by_group"].items()}
        assert got == expected_by_group(stage, result, micro_steps, collectives), f"rank {rank}"
        summed = {}
        for kinds in got.values():
            for kind, count in kinds.items():
                summed[kind] = summed.get(kind, 0) + count
        assert nonzero(result["bytes"]) == summed
        model = result["ring_model_by_group"]
        assert {name: sum(kinds.values()) for name, kinds in got.items()} == \
            {name: model[name] for name in got}, f"rank {rank}: ring_model_bytes_by_group() disagrees"
        assert model["total"] == sum(result["bytes"].values())
    # In the ring model's own terms (S = one full gradient copy): across the G = 2 groups each
    # rank sends 2(G-1)/G * S/k = S/2 per reduction, in the group (k-1)/k * S = S/2 per
    # reduce-scatter (S with Gloo's all-reduce form) and per all-gather.
    full = sum(nbytes for nbytes, grad in result["buckets"] if grad)
    reductions = micro_steps if stage >= 2 else 1
    assert abs(result["by_group"]["inter_group"]["all_reduce"] - reductions * full / 2) <= len(result["buckets"])
