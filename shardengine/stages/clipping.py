"""``clip_grad_norm_`` over a gradient window held as flat slices or replicas."""

from __future__ import annotations

import math

import torch

from ..distributed.hybrid import HybridCommunicator


def clip_window(grads: list[torch.Tensor], comm: HybridCommunicator, replicated: bool, max_norm: float,
                norm_type: float, device: torch.device) -> torch.Tensor:
    """Scale ``grads`` in place so their joint norm is at most ``max_norm``; the total norm.

    ``replicated``: every rank holds the same full gradients (stage 0), so the local norm
    is the total. Else the shard group holds each element once (its replicas hold the
    same shards again), so the partial norms are summed (or maxed) over the shard group.
    """
    total = torch.zeros(1, device=device)
    if norm_type == math.inf:
        for grad in grads:
            total = torch.maximum(total, grad.abs().max().float().reshape(1).to(device))
        if not replicated:
            comm.shard.all_reduce_max(total, label="clip")
        total = total[0]
    else:
        for grad in grads:
            total += grad.float().abs().pow(norm_type).sum().to(device)  # a host shard (offload_params)
        if not replicated:
            comm.shard.all_reduce(total, label="clip").wait()
        total = total[0] ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total
