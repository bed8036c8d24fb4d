"""Memory-bound kernel time the FLOP model leaves out: dequantizing a quantized base, and the
element-wise traffic ``torch.compile`` fuses away.

Used where a given efficiency prices every FLOP (``flat_rate.py``: that efficiency
describes eager runs of 16-bit weights); the default per-operation model
(``operations.py``) counts all element-wise bytes itself and takes only
:func:`dequantization_bytes` and :func:`recomputed_share` from here. Two recipes change
what moves through memory around the matmuls, at the device's memory bandwidth:

- **A quantized base** (NF4, int8): every quantized linear dequantizes its weight to the
  compute dtype before its matmul (bitsandbytes' ``dequantize_4bit``, torchao's
  ``NF4Tensor.to``), reading the stored bytes and writing a 16-bit copy, once in the
  forward, once in the backward (the input's gradient needs the weight) and once more in
  each recomputed forward. The matmul then reads the 16-bit copy as it would a 16-bit base.
- **torch.compile** fuses chains of element-wise kernels into one that reads its inputs and
  writes its outputs once. Per token and layer (bytes, 16-bit activations, h hidden, f MLP
  width), eager against fused:

  * an RMSNorm/LayerNorm written in PyTorch (upcast, square, mean, scale, downcast, weight)
    moves 40·h bytes; fused (or ``--fused-norm`` kernels) 4·h: 36·h saved per norm;
  * each residual add re-read by the norm after it: 2·h saved, two per layer;
  * a gated MLP's ``act(gate) * up``: 10·f eager, 6·f fused: 4·f saved.

  The backward of an element-wise chain reads the saved inputs and the output's gradient
  and writes the input's gradient, twice the forward's traffic, so a step saves three
  times the forward's bytes, plus the forward's once more where layers are recomputed.

>>> from memory_estimator.timing.step import Workload
>>> w = Workload(params=10**9, tokens_per_micro_step=1000, layers=2, hidden=10, mlp_width=20, gated_mlp=True,
...              compile=True)
>>> compile_saved_bytes(w)                 # 2 layers x 1000 tokens x (2·36·10 + 4·10 + 4·20) x 3
5040000.0
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .inputs import Cluster, Workload

UNFUSED_NORM_SAVED = 36          # bytes per hidden element per norm, eager minus fused
RESIDUAL_SAVED = 2 * 2           # two residual adds, one 16-bit re-read each
GATED_MLP_SAVED = 4              # bytes per MLP element: act(gate) * up fused
BACKWARD_TRAFFIC = 2             # backward moves twice the forward's element-wise bytes
COMPUTE_DTYPE_BYTES = 2          # the dequantized copy's dtype


def recomputed_share(workload: "Workload") -> float:
    """Share of the layers whose forward runs again in backward (full / every-k checkpointing)."""
    from ..terms.checkpointing import parse_policy

    policy = parse_policy(workload.checkpointing)
    if policy.kind in ("none", "selective", "mm"):
        return 0.0
    return 1.0 if not workload.layers else policy.checkpointed_layers(workload.layers) / workload.layers


def dequantization_bytes(workload: "Workload") -> tuple[float, float]:
    """(forward, backward) bytes one micro-step's dequantization reads and writes."""
    per_pass = workload.quantized_numel * (workload.quantized_bytes + COMPUTE_DTYPE_BYTES)
    return per_pass, per_pass * (1 + recomputed_share(workload))


def compile_saved_bytes(workload: "Workload") -> float:
    """Bytes of one micro-step's element-wise traffic that ``torch.compile`` fuses away."""
    if not workload.compile or not workload.layers or not workload.hidden:
        return 0.0
    h, f = workload.hidden, workload.mlp_width or 4 * workload.hidden
    per_token = RESIDUAL_SAVED * h + (GATED_MLP_SAVED * f if workload.gated_mlp else 0)
    if not workload.fused_norm:
        per_token += UNFUSED_NORM_SAVED * h * workload.norms_per_layer
    passes = 1 + BACKWARD_TRAFFIC + recomputed_share(workload)
    return float(per_token * workload.layers * workload.tokens_per_micro_step * passes)


def memory_bound_seconds(workload: "Workload", cluster: "Cluster") -> tuple[float, float]:
    """(forward, backward) seconds of one micro-step these kernels add (negative: saved)."""
    rate = cluster.device.memory_bytes_per_s
    forward_dq, backward_dq = dequantization_bytes(workload)
    saved = compile_saved_bytes(workload)
    forward_share = 1 / (1 + BACKWARD_TRAFFIC + recomputed_share(workload))
    return (forward_dq - saved * forward_share) / rate, (backward_dq - saved * (1 - forward_share)) / rate
