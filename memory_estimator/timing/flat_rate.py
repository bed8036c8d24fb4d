"""Compute at one given efficiency: every FLOP at the device's peak x ``--compute-efficiency``
(or a calibrated machine's measured ratio), the time model before it priced each operation by
its mechanism (``operations.py``), kept for a user who states the efficiency of their stack.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import EstimatorInputError

if TYPE_CHECKING:
    from .inputs import Cluster, Workload


def forward_flops(workload: "Workload") -> float:
    """FLOPs of one micro-step's forward on one rank: 2 per parameter per token, plus attention."""
    tokens = workload.tokens_per_micro_step
    return 2.0 * workload.params * tokens + _attention_flops(workload)


def _attention_flops(workload: "Workload") -> float:
    """QK^T and AV: 4·L·h·s FLOPs per token (no causal halving, as in the MFU convention)."""
    if None in (workload.layers, workload.hidden, workload.seq_len):
        return 0.0
    return 4.0 * workload.layers * workload.hidden * workload.seq_len * workload.tokens_per_micro_step


def recompute_flops(workload: "Workload") -> float:
    """FLOPs backward spends recomputing what the checkpointing policy did not keep.

    ``full`` (and ``every-k:K`` on its share of the layers) recomputes the layers' forward
    (not the embeddings' and the head's: they are outside the checkpointed layers);
    ``selective`` the attention core; ``selective:mm`` keeps every matmul and attention
    output, so it recomputes only element-wise ops (no matmul FLOPs); ``selective:op``
    (``selective:mm/2``) recomputes every other matmul: half the layers' FLOPs."""
    from ..terms.checkpointing import parse_policy

    policy = parse_policy(workload.checkpointing)
    layers_forward = forward_flops(workload) - 2.0 * workload.outside_params * workload.tokens_per_micro_step
    if policy.kind == "none":
        return 0.0
    if policy.kind == "selective":
        return _attention_flops(workload)
    if policy.kind == "mm":
        in_layers = workload.params - workload.outside_params
        return 2.0 * in_layers * workload.tokens_per_micro_step * (1 - 1 / policy.mm_stride)
    layers = workload.layers
    share = 1.0 if not layers else policy.checkpointed_layers(layers) / layers
    return layers_forward * share


def backward_flops(workload: "Workload") -> float:
    """Gradients of the inputs (as much as the forward) plus those of the trainable weights."""
    forward = forward_flops(workload)
    if workload.trainable is None:
        return 2 * forward
    return forward + 2.0 * workload.trainable * workload.tokens_per_micro_step


def flat_rate_seconds(workload: "Workload", cluster: "Cluster") -> tuple[float, float]:
    """Every FLOP at peak x the given efficiency, plus the memory-bound kernels' change."""
    from .kernel_time import memory_bound_seconds

    rate = cluster.device.peak_flops(workload.compute_precision) * cluster.compute_efficiency
    if rate <= 0:
        raise EstimatorInputError(f"device {cluster.device.name!r} has no compute rate; give --peak-tflops")
    forward = forward_flops(workload) / rate
    backward = (backward_flops(workload) + recompute_flops(workload)) / rate
    memory_forward, memory_backward = memory_bound_seconds(workload, cluster)
    # What compile saves comes out of the element-wise time inside the matmul-rate estimate;
    # never more than a tenth of what is left (the matmuls themselves stay).
    forward, backward = max(forward + memory_forward, forward / 10), max(backward + memory_backward, backward / 10)
    return workload.grad_accum * forward, workload.grad_accum * backward
