"""Kernel families as users name them (``--kernels liger``): what each replaces, keeps and moves.

[Note: kernel families, from their sources]
A family is the set of fused kernels a training repository patches into the model; each
kernel changes what a layer keeps for backward (``activations.py``) and the bytes its
element-wise work moves (``timing/operations.py``):

==================  ==========================================================================
family              kernels, and what each keeps for backward
==================  ==========================================================================
``liger``           liger-kernel's ``apply_liger_kernel_to_*()`` defaults: ``LigerRMSNorm``
                    (its input and a per-row rstd: a fused norm), ``liger_rotary_pos_emb``
                    (q and k rotated in place), ``LigerSwiGLUMLP`` (``LigerSiLUMulFunction``
                    saves gate and up and recomputes silu(gate)·up in backward; the down
                    projection keeps that product), ``LigerFusedLinearCrossEntropyLoss``
                    (the logits are never written: ``--loss fused``)
``unsloth``         Unsloth's patched Llama/Mistral/Qwen: ``fast_rms_layernorm`` (fused norm),
                    ``fast_rope_embedding``, the LoRA MLP kernel ``apply_lora_mlp_swiglu``
                    (saves X, gate and up; the SwiGLU product, the down projection's input,
                    is recomputed in backward), ``fast_cross_entropy_loss`` (a Triton kernel
                    on the materialised logits that keeps them and a logsumexp per row
                    and writes the gradient into the logits in place: ``--loss inplace``);
                    under transformers < 4.50 the logits are cast to config.json's wider
                    ``torch_dtype`` first: the range's high end (``kernels.py``,
                    ``[Note: logits cast to the checkpoint's dtype]``)
``flash-attn-fused``  flash-attention's training modules: ``dropout_add_layer_norm`` (dropout,
                    residual add and the norm in one kernel: it keeps the norm's input and a
                    1-byte mask), ``apply_rotary_emb`` in place, ``FusedMLP`` with
                    ``checkpoint_lvl=1`` (keeps the first linear's output, recomputes the
                    activation and so the second linear's input), ``CrossEntropyLoss(
                    inplace_backward=True)`` (``--loss inplace``)
``apex``            apex's ``FusedRMSNorm``/``FusedLayerNorm`` only (a fused norm)
==================  ==========================================================================

Families combine (``--kernels liger,flash-attn-fused``): each kernel is on when any named
family has it; the loss is the leanest named (``fused`` before ``inplace``), and an explicit
``--loss`` other than ``plain`` wins. Rotary kernels change neither: an eager rotary saves
only cos and sin (its products' other operands), and the time model's layout term already
moves q and k once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import EstimatorInputError

MLP_KINDS = ("eager", "fused", "fused-recompute")


@dataclass(frozen=True)
class KernelSet:
    """The kernels a run uses, from its families."""

    fused_norm: bool = False
    fused_rope: bool = False
    mlp: str = "eager"                 # "fused": activation recomputed; "fused-recompute": its product too
    fused_residual: bool = False       # dropout + residual add + norm in one kernel
    loss: Optional[str] = None         # the family's cross-entropy ("fused", "inplace"); None: unchanged
    families: tuple[str, ...] = ()
    logits_cast: bool = False          # the logits may be cast to config.json's torch_dtype (a range)

    def union(self, other: "KernelSet") -> "KernelSet":
        losses = [loss for loss in ("fused", "inplace") if loss in (self.loss, other.loss)]
        return KernelSet(self.fused_norm or other.fused_norm, self.fused_rope or other.fused_rope,
                         max(self.mlp, other.mlp, key=MLP_KINDS.index),
                         self.fused_residual or other.fused_residual,
                         losses[0] if losses else None, self.families + other.families,
                         self.logits_cast or other.logits_cast)


FAMILIES: dict[str, KernelSet] = {
    "liger": KernelSet(fused_norm=True, fused_rope=True, mlp="fused", loss="fused", families=("liger",)),
    "unsloth": KernelSet(fused_norm=True, fused_rope=True, mlp="fused-recompute", loss="inplace",
                         families=("unsloth",), logits_cast=True),
    "flash-attn-fused": KernelSet(fused_norm=True, fused_rope=True, mlp="fused-recompute", fused_residual=True,
                                  loss="inplace", families=("flash-attn-fused",)),
    "apex": KernelSet(fused_norm=True, families=("apex",)),
}


def kernel_set(names: str | Sequence[str] | None) -> KernelSet:
    """The union of the named families (a comma-separated string or a list).

    >>> kernel_set("liger").loss, kernel_set("liger,apex").families
    ('fused', ('liger', 'apex'))
    """
    if names is None:
        return KernelSet()
    items = [part.strip() for part in names.split(",")] if isinstance(names, str) else list(names)
    result = KernelSet()
    for name in items:
        if name not in FAMILIES:
            raise EstimatorInputError(f"unknown kernel family {name!r}; choose from {', '.join(FAMILIES)} "
                                      "(comma-separated to combine)")
        result = result.union(FAMILIES[name])
    return result
