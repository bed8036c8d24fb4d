"""``WeightSync`` and the stream's contract: a colocated sync at N = 2 with its numerics report, and the
errors a user meets (bad options, a step during a stream, a released bucket, a receiver's mismatch)."""

from __future__ import annotations

import pytest
import torch

import shardengine as se
import stream_cases as cases
from shardengine.rl import ModuleReceiver, WeightSync, compare_logprobs


@pytest.mark.parametrize("stage", [1, 3])
def test_a_colocated_sync_loads_every_rank_and_reports_its_numerics(rank_pools, stage) -> None:
    for found in rank_pools.get(2).run(cases.colocated_sync_reports, stage, timeout=300):
        assert found["equal"] and found["buckets"] > 1
        assert found["first"] and 0 < found["first_mean"] < 0.05, found["text"]
        assert not found["wrong"], "a rollout with a wrong weight must not pass as dtype rounding"
        assert "explained by the dtype" in found["text"]


def _model(stage: int = 3):
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage)


@pytest.mark.parametrize("options, message", [
    (dict(bucket_bytes=0), "bucket_bytes must be an int >= 1"),
    (dict(bucket_bytes=1.5), "bucket_bytes must be an int >= 1"),
    (dict(receivers=[3]), "receivers must be 'all', a rank or a list of distinct ranks"),
    (dict(receivers="rank0"), "receivers must be 'all'"),
    (dict(dtype="int8"), "dtype must be one of"),
])
def test_bad_stream_options_are_config_errors(options, message) -> None:
    model, _ = _model()
    with pytest.raises(se.ConfigError, match=message):
        model.stream_weights(**options)


def test_stepping_during_a_stream_is_refused() -> None:
    model, optimizer = _model(stage=1)
    stream = iter(model.stream_weights(bucket_bytes=64))
    next(stream)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(se.ConfigError, match="stepped while the weights were being streamed"):
        next(stream)


def test_a_released_bucket_says_so_and_copied_tensors_stay_right() -> None:
    model, _ = _model()
    full = model.full_state_dict()
    stream = iter(model.stream_weights(bucket_bytes=64))
    first = next(stream)
    kept = dict(first)  # the consumer keeps the tensors themselves: their values stay right
    next(stream)
    with pytest.raises(se.ConfigError, match="was released when the next one was requested"):
        list(first)
    assert all(torch.equal(t, full[k]) for k, t in kept.items())


def test_a_receiver_refuses_a_stream_that_does_not_match_it() -> None:
    model, _ = _model()
    with pytest.raises(se.errors.StateDictMismatch, match="shape mismatch"):
        WeightSync(model, ModuleReceiver(torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Linear(9, 2)))).sync()
    with pytest.raises(se.errors.StateDictMismatch, match="ended without"):
        WeightSync(model, ModuleReceiver(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2),
                                                             torch.nn.Linear(2, 2)))).sync()


def test_a_check_needs_a_probe() -> None:
    model, _ = _model()
    with pytest.raises(se.ConfigError, match="needs a probe batch"):
        WeightSync(model, ModuleReceiver(torch.nn.Linear(1, 1)), check_every=2)


def test_an_fp32_rollout_is_explained_only_at_rounding_level() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    assert compare_logprobs(trainer, trainer + 1e-7, rollout_dtype=torch.float32).explained_by_dtype
    assert not compare_logprobs(trainer, trainer + 1e-3, rollout_dtype=torch.float32).explained_by_dtype


def test_a_stream_on_one_rank_only_fails_promptly_naming_it() -> None:
    """The stream is an announced collective call (step/call_agreement.py), as full_state_dict() is."""
    from rank_pool import RankPoolRegistry

    pools = RankPoolRegistry()  # a private pool: the failed ranks are killed, not stopped
    try:
        results = pools.get(2).run(cases.stream_on_rank0_only, timeout=120)
    finally:
        pools.shutdown_all(graceful=False)
    for result in results:
        assert result["error"] is not None and "model.stream_weights()" in result["error"], result
        assert "rank(s) [0]" in result["error"] and result["seconds"] < 20, result


def test_leaving_a_stream_early_on_every_rank_leaves_the_model_usable(rank_pools) -> None:
    assert all(rank_pools.get(2).run(cases.stream_left_early, timeout=300))
