"""Per-step statistics: traffic by collective kind, time in collectives, peak memory."""

from __future__ import annotations

import torch
from torch import nn

import shardengine as se
from shardengine.distributed.traffic import ring_bytes
from shardengine.step.agreement import vector_bytes


def two_steps_of_stats(stage: int) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 5))
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage=stage)
    model.reset_comm_stats()
    per_step = []
    for _ in range(3):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        per_step.append(model.step_stats())
    full_bytes = 4 * sum(b.layout.padded_numel for b in model.engine.buckets)
    return {"stats": per_step, "full_bytes": full_bytes, "report": model.memory_report(),
            "ring_model": model.ring_model_bytes(1)}


def test_step_stats_report_one_steps_traffic_and_peak(rank_pools):
    for result in rank_pools.get(2).run(two_steps_of_stats, 2):
        first, second, third = result["stats"]
        assert second.bytes_by_kind == third.bytes_by_kind  # since the previous call, not cumulative
        # the first step also agrees once on the batch weights' reference (step/batch_weights.py)
        assert first.bytes_by_kind == {**second.bytes_by_kind, "batch_weights": ring_bytes("all_reduce", 8, 2)}
        # Gloo: the reduce-scatter goes out as an all-reduce (distributed/communicator.py), then the all-gather,
        # and the step's small agreement all-reduce (step/agreement.py; 4 parameters, no buffers).
        expected = ring_bytes("all_reduce", result["full_bytes"], 2) + ring_bytes("all_gather", result["full_bytes"], 2)
        assert second.bytes_by_kind["step_sync"] == ring_bytes("all_reduce", vector_bytes(4), 2)
        assert second.bytes_total == expected + second.bytes_by_kind["step_sync"] == result["ring_model"]
        assert second.comm_seconds >= 0.0
        report = result["report"]
        assert second.peak_tracked_bytes >= report.model_states + result["full_bytes"] // 2
        assert second.peak_device_bytes is None  # CPU: no device allocator to ask
        assert second.loss_scale is None and second.skipped_steps == 0  # fp32: no loss scaling
