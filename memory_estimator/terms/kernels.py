"""What memory-saving kernels keep for backward: fused norms, compiled graphs, fused losses.

- ``fused_norm`` (Liger/Apex/TE RMSNorm kernels): the norm saves its input and a per-row
  rstd; the eager HF/Meta RMSNorm keeps an fp32 upcast of its input and the normalized
  output as well.
- ``compiled`` (``torch.compile``, inductor): AOTAutograd splits forward and backward with
  the min-cut rematerialization partitioner (``torch/_functorch/partitioners.py``,
  ``min_cut_rematerialization_partition``), which saves what is expensive to recompute
  (the inputs and outputs of matmuls and attention) and recomputes the fusible
  element-wise ops in between: a norm keeps its input only (no fp32 upcast), the gated
  MLP's act(gate) is recomputed while gate, up and the product (the down projection's
  input) stay. (torchtune's table: compiling Llama 3.2 3B at 2 x 4096 tokens saves 9.0
  GiB of 60.0; the fp32 norm copies and act(gate) are 8.75 GiB of it, plus fragmentation.)
- ``loss``: ``plain`` cross-entropy materializes the full-vocabulary logits, their fp32
  upcast and log-softmax, and the backward's fp32 gradients (``(12 + c)·b·s·V``);
  ``chunked`` (torchtune's ``CEWithChunkedOutputLoss``, litgpt's ``chunked_cross_entropy``)
  computes the logits and the loss chunk by chunk (8 chunks): every chunk's log-softmax
  output stays for backward (fp32 in torchtune's loss; bf16 beside its bf16 logits in
  litgpt's: 4 bytes per logit either way) and one chunk's c-byte logits are in flight:
  ``4·b·s·V + c·b·s·V/8``; compiled (``torch.compile`` of each chunk's loss, as torchtune
  does with ``compile=True``), the partitioner keeps the c-byte logits and a logsumexp per
  row and recomputes the softmax in backward: ``c·b·s·V + c·b·s·V/8`` (torchtune's Llama
  3.2 3B rows with checkpointing, in-backward, offloading, LoRA and QLoRA all fit it;
  the compiled plain loss of the same table keeps its full (12 + c) bytes);
  ``fused`` (Liger's ``FusedLinearCrossEntropy``, Apple's Cut Cross-Entropy,
  Unsloth) never writes the full logits: it works on token chunks sized so a chunk's
  fp32 logits are about ``b·s·h`` elements, and keeps the gradient of the hidden state;
  ``inplace`` (flash-attention's ``CrossEntropyLoss(inplace_backward=True)``, Unsloth's
  ``fast_cross_entropy_loss``) keeps the c-byte logits and a logsumexp per row and writes
  their gradient over them: ``c·b·s·V``.

[Note: logits cast to the checkpoint's dtype]
Unsloth's ``CausalLM_fast_forward`` (``unsloth/models/llama.py``, every release from 2024.3
on) computes the head in the autocast dtype and then casts the logits to
``config.torch_dtype`` (``logits = logits.to(self.config.torch_dtype)``). What that dtype is
depends on transformers, not on Unsloth: ``from_pretrained(torch_dtype=<a torch.dtype>)``
sets ``config.torch_dtype`` to it from transformers 4.50 on (4.50.3 to 4.55.4 and 5.x, whose
``config.dtype`` holds it: the cast is to the 16-bit dtype the model was loaded in, no copy),
while 4.43.3 to 4.49.0 (the releases checked) set it for sub-configs only and leave
config.json's. A checkpoint whose config says ``float32`` (``google/gemma-2-2b`` ships fp32
weights and says so) then gets fp32 logits: at the cast the c-byte head output and its 4-byte copy are both alive, the loss keeps
the 4-byte logits and writes their gradient over them, and in backward the cast's gradient (c
bytes) is made while that one is still alive: ``(c + 4)·b·s·V`` at either moment instead of
``c·b·s·V`` (with a 256k vocabulary, 2 GiB more at 2 × 1024 tokens). The estimator is not told
the transformers version, so with the ``unsloth`` family and a config wider than the
activations' dtype the logits term is a stated range (``plan/memory.py``,
``_with_logits_cast``): its point and low end without the cast (today's transformers), its
high end the same plan priced with it (``loss_bytes(..., cast=4)`` and the longer batches
replayed with it), which the verdict is judged on. A 16-bit checkpoint has no range.

>>> loss_bytes("plain", 32000, 4096, 1, 1024, 2) / 2**20
437.5
>>> loss_bytes("fused", 32000, 4096, 1, 1024, 2) / 2**20
32.0
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..errors import EstimatorInputError

if TYPE_CHECKING:
    from .adapters import Adapters

LOSSES = ("plain", "chunked", "fused", "inplace")
CHUNKS = 8  # torchtune's num_output_chunks; litgpt's head chunks are smaller still


@dataclass(frozen=True)
class Kernels:
    """The kernels a run uses, and the frozen-base facts that change what layers keep."""

    fused_norm: bool = False
    compiled: bool = False
    adapters: Optional["Adapters"] = None
    mlp: str = "eager"      # "fused": the activation recomputed in backward; "fused-recompute": its product too
    linear_inputs_kept: bool = False  # every linear saves its input, frozen or not (DeepSpeed's zero.Init linear)

    def __post_init__(self) -> None:
        if self.compiled and not self.fused_norm:
            object.__setattr__(self, "fused_norm", True)  # inductor fuses the norm's element-wise ops
        if self.compiled and self.mlp == "eager":
            object.__setattr__(self, "mlp", "fused")      # ... and recomputes the MLP's activation

    def keeps(self, *projections: str) -> bool:
        """Whether the layer keeps the input of any of these projections (frozen ones may not)."""
        if self.adapters is None or not self.adapters.frozen_base or self.linear_inputs_kept:
            return True
        kept = self.adapters.frozen_inputs_kept()
        return any(name in kept for name in projections)


def check_loss(loss: str) -> str:
    if loss not in LOSSES:
        raise EstimatorInputError(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)}")
    return loss


def loss_bytes(loss: str, vocab: int, hidden: int, micro_batch: int, seq_len: int, c: int,
               compiled: bool = False, upcast: bool = True, cast: int | None = None, softcap: bool = False) -> int:
    """Logits and cross-entropy buffers at the start of backward, per micro-batch.

    A compiled chunked loss (torchtune compiles each chunk's cross-entropy with the model)
    keeps each chunk's c-byte logits and a per-row logsumexp, and recomputes the softmax in
    backward, instead of the fp32 log-softmax. ``upcast=False``: a plain loss computed on the
    c-byte logits themselves (``F.cross_entropy`` on bf16/fp16 logits, no ``.float()``: GPT-2
    and Qwen-1 in their own code, a Lightning module's criterion): the logits, their shifted
    copy and the c-byte log-probabilities, ``3·c·b·s·V`` (its backward's two gradients replace
    the logits and the copy, freed by then).

    >>> loss_bytes("plain", 32000, 4096, 1, 1024, 2, upcast=False) / 2**20
    187.5

    ``cast``: the bytes per element of the dtype an in-place loss's logits are cast to first
    (``[Note: logits cast to the checkpoint's dtype]``); the c-byte logits and the cast copy
    are alive together, in forward and again in backward.

    >>> loss_bytes("inplace", 256000, 2304, 2, 1024, 2, cast=4) // 2**20
    3000

    ``softcap``: the model caps its logits (``final_logit_softcapping``, [Note: logit soft-capping]).

    >>> loss_bytes("plain", 256000, 2304, 1, 1024, 2, softcap=True) - loss_bytes("plain", 256000, 2304, 1, 1024, 2)
    524288000
    """
    tokens = micro_batch * seq_len
    capped = softcap_bytes(loss, c) * tokens * vocab if softcap else 0
    if check_loss(loss) == "plain":
        return (12 + c if upcast or c == 4 else 3 * c) * tokens * vocab + capped
    if loss == "chunked":
        kept = c if compiled else 4
        return kept * tokens * vocab + math.ceil(c * tokens * vocab / CHUNKS) + capped
    if loss == "inplace":
        logits = c + cast if cast not in (None, c) else c   # a cast: the head's output beside its copy
        return logits * tokens * vocab + 4 * tokens   # the logits, their gradient written over them; a logsumexp per row
    return (4 + c) * tokens * hidden + c * tokens * hidden  # one chunk's logits, its gradient; d(hidden)


def softcap_bytes(loss: str, c: int) -> int:
    """Bytes per logit that soft-capping the logits adds before this loss.

    [Note: logit soft-capping]
    Gemma-2 (and Gemma-3 when its config sets it) caps the logits as
    ``tanh(logits / cap) * cap`` in the model's forward (transformers'
    ``Gemma2ForCausalLM.forward``); the division and the product by the constant save
    nothing, ``tanh`` saves its c-byte output for its backward, and that output is alive
    beside the capped logits the loss reads, from forward into the loss's backward: one
    more c-byte copy of the logits for a ``plain`` or ``chunked`` loss (each chunk's).
    The fused and in-place kernels take the cap as an argument and apply it on the
    chunk or in place (Liger's ``softcap``, Unsloth's ``logit_softcapping``): nothing more.

    >>> softcap_bytes("plain", 2), softcap_bytes("inplace", 2)
    (2, 0)
    """
    return c if check_loss(loss) in ("plain", "chunked") else 0
