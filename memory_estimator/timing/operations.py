"""One micro-step as the operations the device runs, each priced by what bounds it.

[Note: the step's time from mechanisms]
The compute time of a micro-step is the sum over its operations, each at the rate its
mechanism allows on the device (constants: ``hardware/achievable.py``, sources in
``docs/time-model.md``), instead of all FLOPs at one fitted efficiency:

* **matmul** (the dense layers' linears and the head; LoRA's A and B): a roofline,
  ``max(FLOPs / (peak x matmul fraction), bytes / (bandwidth x bandwidth fraction))``.
  The base's matmuls are compute-bound at training sizes; LoRA's rank-r A and B are not
  (about r FLOPs per byte, under every device's ridge point), so their cost is the
  activations they read and write. Backward: the input's gradient (as many FLOPs as the
  forward) plus the weights' gradient where the weights train; a frozen base has none.
* **attention** (causal flash attention, as PyTorch's SDPA runs it): forward 2·L·h·s FLOPs
  per token (QKᵀ and AV, half of the 4·L·h·s of the dense count under the causal mask),
  backward 2.5x that (its five matmuls to the forward's two: the FlashAttention-2 count),
  at the kernel's published fraction of the peak.
* **memory** (element-wise kernels, norms, the loss, dropout, a quantized base's
  dequantization): bytes read and written over the achieved bandwidth. Per token and
  layer, 16-bit activations (2 bytes), h hidden, f MLP width, eager against compiled:

  ====================  ======================  ========================
  kernel                eager bytes             ``torch.compile``
  ====================  ======================  ========================
  norm (per norm)       40·h RMSNorm in torch   4·h (one read, one write)
                        ops, 4·h a fused kernel
  residual adds (2)     12·h                    8·h (folded into the norm)
  MLP activation        gated 10·f, GELU 4·f    gated 6·f, GELU 4·f
  q, k, v, out layout   4·(2·h + 2·kv)          same
  dropout (2, if on)    10·h (+ 1-byte masks)   same
  ====================  ======================  ========================

  The backward of an element-wise chain reads the saved inputs and the output's gradient
  and writes the input's gradient: twice the forward's bytes. The loss over a vocabulary
  V per token: eager cross-entropy (fp32 upcast, log-softmax, its backward, the cast back)
  36·V, compiled (``compile`` with a plain or chunked loss) 6·V, an in-place kernel
  (flash-attention's, Unsloth's: read the logits in forward, read them and write the
  gradient over them in backward) 6·V, a fused linear cross-entropy that never writes the
  logits 0. Kernel families (``--kernels``, ``terms/kernel_families.py``) move what
  ``compile`` would for the kernels they fuse: a fused norm 4·h, a fused SwiGLU 6·f, a fused
  dropout-residual-norm the compiled residual adds.
* **recomputation**: checkpointed layers run their forward operations again in backward
  (``full``/``every-k``), ``selective`` the attention, ``selective:mm`` the element-wise
  kernels, ``selective:op`` every other matmul too.

>>> from memory_estimator.timing.step import Workload
>>> w = Workload(params=10**9, tokens_per_micro_step=1000, layers=2, hidden=10, seq_len=100)
>>> [(op.name, op.phase, op.flops) for op in micro_step_operations(w) if op.kind == "attention"]
[('attention', 'forward', 4000000.0), ('attention', 'backward', 10000000.0)]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..hardware.achievable import Achievable, achievable
from .kernel_time import dequantization_bytes, recomputed_share

if TYPE_CHECKING:
    from ..hardware.rates import DeviceRates
    from .inputs import Workload

ACTIVATION_BYTES = 2
NORM_EAGER, NORM_FUSED = 40, 4                # bytes per hidden element per norm
RESIDUALS_EAGER, RESIDUALS_COMPILED = 12, 8   # two adds per layer
GATED_EAGER, GATED_COMPILED, GELU = 10, 6, 4  # bytes per MLP element
LAYOUT = 4                                    # q, k, v and the output read and written once
DROPOUT = 10                                  # two dropouts on h: read, write, 1-byte mask each
BACKWARD_TRAFFIC = 2                          # an element-wise backward moves twice the forward
LOSS_EAGER, LOSS_COMPILED = 36, 6             # bytes per logit
LOSS_INPLACE = 3 * ACTIVATION_BYTES           # read the logits, read them again and write their gradient over them
ATTENTION_BACKWARD_FLOPS = 2.5                # FlashAttention-2: five matmuls to the forward's two
LORA_ADD_EAGER, LORA_ADD_COMPILED = 10, 6     # scale * B(A(x)) added to the base's output, per out
GRAD_ACCUMULATE = 6                           # A's input gradient added into the base's: read 2, write 1
LORA_DROPOUT = 5                              # read, write and a 1-byte mask per input element


@dataclass(frozen=True)
class Operation:
    """One kind of kernel of a micro-step, summed over the model: what it computes and moves."""

    name: str
    phase: str      # "forward" or "backward" (recomputation runs in backward)
    kind: str       # "matmul", "attention" or "memory"
    flops: float = 0.0
    bytes: float = 0.0


def micro_step_operations(workload: "Workload") -> tuple[Operation, ...]:
    """The operations of one micro-step on one rank, forward, backward and recomputed."""
    forward = _forward_operations(workload)
    backward = [_backward_of(op, workload) for op in forward]
    backward += _extra_backward(workload)
    recomputed = [Operation(f"recompute {op.name}", "backward", op.kind, op.flops * share, op.bytes * share)
                  for op, share in _recomputed(forward, workload)]
    return tuple(op for op in (*forward, *backward, *recomputed) if op.flops or op.bytes)


def operation_seconds(op: Operation, device: "DeviceRates", precision: str, rates: Achievable) -> float:
    """Seconds of ``op`` on ``device``: its roofline (matmul), kernel rate (attention) or bytes,
    over the generation's sustained fraction (``achievable.py``)."""
    bandwidth = device.memory_bytes_per_s * rates.bandwidth * rates.sustained
    peak = device.peak_flops(precision) * rates.sustained
    if op.kind == "memory":
        return op.bytes / bandwidth
    if op.kind == "attention":
        fraction = rates.attention_forward if op.phase == "forward" else rates.attention_backward
        return op.flops / (peak * fraction)
    return max(op.flops / (peak * rates.matmul), op.bytes / bandwidth)


def device_achievable(device: "DeviceRates") -> Achievable:
    return achievable(device.name, device.generation)


# --------------------------------------------------------------------------- forward


def _forward_operations(w: "Workload") -> list[Operation]:
    t = w.tokens_per_micro_step
    ops = [Operation("matmuls", "forward", "matmul", 2.0 * _dense_params(w) * t, _dense_bytes(w))]
    if _known_shape(w) and w.seq_len:
        ops.append(Operation("attention", "forward", "attention", 2.0 * w.layers * w.hidden * w.seq_len * t))
    ops.append(Operation("element-wise", "forward", "memory", bytes=_elementwise_bytes(w) * t))
    ops.append(Operation("loss", "forward", "memory", bytes=_loss_bytes(w) * t / (1 + BACKWARD_TRAFFIC)))
    ops += _adapter_operations(w)
    dequantize, _ = dequantization_bytes(w)
    ops.append(Operation("dequantize", "forward", "memory", bytes=dequantize))
    return ops


def _known_shape(w: "Workload") -> bool:
    return bool(w.layers and w.hidden)


def _adapter_params(w: "Workload") -> int:
    return (w.trainable or 0) if w.lora_rank else 0


def _dense_params(w: "Workload") -> int:
    return max(0, w.params - _adapter_params(w))


def _dense_bytes(w: "Workload") -> float:
    """Weights read once; each layer's input and output (its linears as one h-wide matmul)."""
    dense = _dense_params(w)
    if not _known_shape(w):
        return ACTIVATION_BYTES * dense
    t = w.tokens_per_micro_step
    return ACTIVATION_BYTES * (dense + w.layers * t * w.hidden + t * dense / w.hidden)


def _elementwise_bytes(w: "Workload") -> float:
    """Forward bytes per token of the layers' element-wise kernels (table in the module doc)."""
    if not _known_shape(w):
        return 0.0
    h, f, kv = w.hidden, w.mlp_width or 4 * w.hidden, w.kv_width or w.hidden
    fused = w.compile or w.fused_norm or w.fused_residual or w.norm != "rmsnorm"
    per_layer = w.norms_per_layer * (NORM_FUSED if fused else NORM_EAGER) * h
    per_layer += (RESIDUALS_COMPILED if w.compile or w.fused_residual else RESIDUALS_EAGER) * h
    per_layer += (GATED_COMPILED if w.compile or w.fused_mlp else GATED_EAGER) * f if w.gated_mlp else GELU * f
    per_layer += LAYOUT * (2 * h + 2 * kv) + (DROPOUT * h if w.dropout else 0)
    return float(per_layer * w.layers)


def _loss_bytes(w: "Workload") -> float:
    """Forward + backward bytes per token of the cross-entropy over the vocabulary."""
    if not w.vocab or w.loss == "fused":
        return 0.0
    if w.loss == "inplace" and w.logits_cast not in (None, ACTIVATION_BYTES):
        # the loss on the cast copy, and the cast both ways: read c, write l; read l, write c (kernels.py)
        cast = w.logits_cast
        return float((3 * cast + 2 * (ACTIVATION_BYTES + cast)) * w.vocab)
    if w.loss == "inplace":
        return float(LOSS_INPLACE * w.vocab)
    return float((LOSS_COMPILED if w.compile else LOSS_EAGER) * w.vocab)


def _adapter_operations(w: "Workload") -> list[Operation]:
    """LoRA's A (in -> r) and B (r -> out) on every adapted linear, their sum into the base's
    output and their dropout: ``adapter_inputs``/``adapter_outputs`` sum in and out over them."""
    if not w.lora_rank or not w.adapter_inputs:
        return []
    t, r, ins, outs = w.tokens_per_micro_step, w.lora_rank, w.adapter_inputs, w.adapter_outputs
    a = Operation("LoRA A", "forward", "matmul", 2.0 * t * r * ins, ACTIVATION_BYTES * t * (ins + r))
    b = Operation("LoRA B", "forward", "matmul", 2.0 * t * r * outs, ACTIVATION_BYTES * t * (outs + r))
    add = (LORA_ADD_COMPILED if w.compile else LORA_ADD_EAGER) * outs
    dropout = LORA_DROPOUT * ins if w.lora_dropout else 0
    return [a, b, Operation("LoRA add and dropout", "forward", "memory", bytes=float(t * (add + dropout)))]


# --------------------------------------------------------------------------- backward


def _backward_of(op: Operation, w: "Workload") -> Operation:
    """An operation's backward: input gradients (+ weight gradients where trained)."""
    if op.kind == "attention":
        return Operation(op.name, "backward", op.kind, ATTENTION_BACKWARD_FLOPS * op.flops)
    if op.name == "matmuls":
        trained = _dense_params(w) if w.trainable is None else max(0, w.trainable - _adapter_params(w))
        weight_grads = 2.0 * trained * w.tokens_per_micro_step
        return Operation(op.name, "backward", op.kind, op.flops + weight_grads, op.bytes * (1 + bool(weight_grads)))
    if op.name.startswith("LoRA") and op.kind == "matmul":  # both gradients: A and B train
        return Operation(op.name, "backward", op.kind, 2 * op.flops, 2 * op.bytes)
    if op.name == "loss":
        return Operation(op.name, "backward", op.kind, bytes=BACKWARD_TRAFFIC * op.bytes)
    if op.name == "dequantize":  # once more: the input's gradient needs the weight
        return Operation(op.name, "backward", op.kind, bytes=op.bytes)
    return Operation(op.name, "backward", op.kind, op.flops, BACKWARD_TRAFFIC * op.bytes)


def _extra_backward(w: "Workload") -> list[Operation]:
    """LoRA A's input gradient summed into the frozen base's."""
    if not w.lora_rank or not w.adapter_inputs:
        return []
    return [Operation("LoRA input-gradient add", "backward", "memory",
                      bytes=float(GRAD_ACCUMULATE * w.adapter_inputs * w.tokens_per_micro_step))]


def _recomputed(forward: list[Operation], w: "Workload") -> list[tuple[Operation, float]]:
    """(operation, share of it run again) under the checkpointing policy."""
    from ..terms.checkpointing import parse_policy

    policy = parse_policy(w.checkpointing)
    if policy.kind == "none":
        return []
    if policy.kind == "selective":
        return [(op, 1.0) for op in forward if op.kind == "attention"]
    layers_share = _layers_share(w)
    if policy.kind == "mm":
        matmul_share = layers_share * (1 - 1 / policy.mm_stride)
        return [(op, 1.0) for op in forward if op.name == "element-wise"] + \
               [(op, matmul_share) for op in forward if op.name == "matmuls"]
    share = recomputed_share(w)
    return [(op, share * (layers_share if op.name == "matmuls" else 1.0)) for op in forward if op.name != "loss"]


def _layers_share(w: "Workload") -> float:
    """Share of the dense matmul FLOPs inside the layers (not the embeddings and head)."""
    dense = _dense_params(w)
    return 1.0 if not dense else max(0.0, dense - w.outside_params) / dense
