"""Mixed precision, fp16 loss scaling and optimizer offload against fp32 references.

Worker functions are module level: the rank pool imports them by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import shardengine as se
from shardengine.errors import LossScaleCollapsed
from shardengine.step.mixed_precision import DynamicLossScaler
from toy_models import Net

VOCAB, STEPS = 17, 3


def tiny_lm() -> Net:
    """Embedding, 3 residual MLP blocks of width 12, head."""
    return Net(VOCAB, 12, [12, 12], residual=True, buffer=False)


def _batches(world: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (world, 4, 6), generator=generator) for _ in range(STEPS)]


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


def _train_sharded(stage: int, options: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = tiny_lm()
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9),
                                stage=stage, **options)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for batch in _batches(model.world_size):
        _loss(model, batch[rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.full_state_dict()


def _train_reference(world: int, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = tiny_lm()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    for batch in _batches(world):
        (sum(_loss(net, batch[r]) for r in range(world)) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    return net.state_dict()


def _max_rel_error(state: dict, reference: dict) -> float:
    return max(((state[k].float() - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
               for k, v in reference.items())


def mixed_precision_error(stage: int, dtype: str) -> float:
    """Relative error of a mixed-precision run against fp32 single-process training."""
    options = {"param_dtype": dtype}
    if dtype == "fp16":
        options["initial_loss_scale"] = 256.0  # no overflow: every step is taken
    state = _train_sharded(stage, options)
    reference = _train_reference(torch.distributed.get_world_size())
    assert all(v.dtype == torch.float32 for v in state.values()) or dtype != "fp32"
    return _max_rel_error(state, reference)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype, tolerance", [("bf16", 3e-2), ("fp16", 4e-3)])
def test_mixed_precision_matches_fp32_within_dtype_tolerance(rank_pools, stage, dtype, tolerance):
    errors = rank_pools.get(2).run(mixed_precision_error, stage, dtype)
    assert max(errors) < tolerance, errors


def offload_matches_no_offload(stage: int) -> float:
    plain = _train_sharded(stage, {})
    offloaded = _train_sharded(stage, {"offload_optimizer": True})
    return max((plain[k] - offloaded[k]).abs().max().item() for k in plain)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_gives_the_same_parameters(rank_pools, stage):
    assert rank_pools.get(2).run(offload_matches_no_offload, stage) == [0.0, 0.0]


def offload_moves_optimizer_state_to_host(stage: int) -> tuple:
    torch.manual_seed(0)
    net = tiny_lm()
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage=stage,
                                offload_optimizer=True, param_dtype="bf16")
    _loss(model, torch.randint(0, VOCAB, (2, 5))).backward()
    optimizer.step()
    report = model.memory_report()
    shard = sum(b.layout.shard_numel for b in model.engine.buckets)
    owned = sum(f.numel for b in model.engine.buckets for f in b.layout.fragments(b.rank))
    return report.optimizer_states, report.host_optimizer_states, shard, owned


def test_offload_reports_master_and_states_in_host_memory(rank_pools):
    for device_bytes, host_bytes, shard, owned in rank_pools.get(2).run(offload_moves_optimizer_state_to_host, 2):
        assert device_bytes == 0
        # fp32 master of the slice, padding included; Adam's two moments of its real elements
        assert host_bytes == 4 * shard + 8 * owned


def fp16_overflow_skips_the_step_everywhere(**options) -> dict:
    """The last rank alone produces an inf gradient: every rank must skip that step."""
    torch.manual_seed(0)
    net = tiny_lm()
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=2,
                                param_dtype="fp16", initial_loss_scale=1024.0, **options)
    before = model.full_state_dict()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    loss = _loss(model, torch.randint(0, VOCAB, (2, 5)))
    (loss * (float("inf") if rank == world - 1 else 1.0)).backward()
    optimizer.step()
    optimizer.zero_grad()
    after_skip = model.full_state_dict()
    stats = model.step_stats()  # what a training loop logs
    _loss(model, torch.randint(0, VOCAB, (2, 5))).backward()
    optimizer.step()
    changed = any(not torch.equal(after_skip[k], v) for k, v in model.full_state_dict().items())
    unchanged = all(torch.equal(before[k], v) for k, v in after_skip.items())
    later = model.step_stats()  # since the previous call: a clean step
    return {"unchanged_by_skip": unchanged, "skipped": stats.skipped_steps, "scale": stats.loss_scale,
            "next_step_applied": changed, "skipped_later": later.skipped_steps}


@pytest.mark.parametrize("world,options", [(2, {}), (4, {"shard_group_size": 2})], ids=["plain", "hybrid"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_all(rank_pools, world, options):
    """Hybrid sharding too: the overflow is agreed over all ranks, not just the shard group."""
    for result in rank_pools.get(world).run(fp16_overflow_skips_the_step_everywhere, **options):
        assert result == {"unchanged_by_skip": True, "skipped": 1, "scale": 512.0,
                          "next_step_applied": True, "skipped_later": 0}


def test_loss_scaler_grows_backs_off_and_reports_collapse():
    scaler = DynamicLossScaler(scale=4.0, growth_interval=2, max_skips_at_min=3)
    scaler.update(False), scaler.update(False)
    assert scaler.scale == 8.0
    for expected in (4.0, 2.0, 1.0):
        scaler.update(True)
        assert scaler.scale == expected
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.update(True), scaler.update(True)
    assert any("minimum" in str(w.message) for w in caught)
    with pytest.raises(LossScaleCollapsed, match="skipped in a row"):
        scaler.update(True)


def test_world_size_one_bf16_without_process_group():
    torch.manual_seed(0)
    net = tiny_lm()
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3,
                                param_dtype="bf16")
    _loss(model, torch.randint(0, VOCAB, (2, 5))).backward()
    optimizer.step()
    assert all(torch.isfinite(v).all() for v in model.full_state_dict().values())
    assert {b.master.dtype for b in model.engine.buckets} == {torch.float32}


@pytest.mark.parametrize("options, message", [
    ({"param_dtype": "int8"}, "param_dtype"),
    ({"param_dtype": "bf16", "loss_scale": "dynamic"}, "fp16 training only"),
    ({"param_dtype": "fp16", "loss_scale": -1}, "loss_scale must be a finite number > 0"),
    ({"offload_optimizer": True, "stage": 0}, "stage >= 1"),
    ({"prefetch": -1}, "prefetch"),
])
def test_precision_options_are_validated(options, message):
    net = tiny_lm()
    options = {"stage": 2, **options}
    with pytest.raises(se.ConfigError, match=message):
        se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), **options)
