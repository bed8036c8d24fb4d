"""Analytic activation memory of a GPT-style transformer (Korthikanti et al. 2022).

Per layer, with 16-bit activations and no recomputation, one micro-batch stores
``s·b·h·(34 + 5·a·s/h)`` bytes: 34·sbh for the linear/norm/dropout inputs and
5·a·s²·b for the attention score, softmax and dropout matrices.

- fused/flash attention: the s×s matrices are never stored → 34·sbh.
- selective recomputation: the attention core is recomputed in backward → 34·sbh.
- full checkpointing: only each layer's input (2·sbh) is kept, plus one layer's full
  activations while it is being recomputed.
- fp32 activations double every term.

The formula assumes a 4h MLP; gated MLPs (SwiGLU) with ~8h/3 width land close to it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import EstimatorInputError
from .stats import Architecture

CHECKPOINTING_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ActivationInputs:
    """One micro-batch's shape and how its activations are kept."""

    micro_batch: int
    seq_len: int
    checkpointing: str = "none"
    fused_attention: bool = True
    fp32_activations: bool = False


def check_checkpointing(mode: str) -> str:
    if mode not in CHECKPOINTING_MODES:
        raise EstimatorInputError(
            f"unknown checkpointing {mode!r}; choose from {', '.join(CHECKPOINTING_MODES)}")
    return mode


def layer_activation_bytes(arch: Architecture, micro_batch: int, seq_len: int, *, store_scores: bool) -> int:
    """16-bit bytes one layer keeps for backward; ``store_scores`` keeps the 5·a·s²·b term.

    >>> layer_activation_bytes(Architecture(1, 4096, 32, 32000), 1, 4096, store_scores=False) / 2**20
    544.0
    """
    linear_terms = 34 * seq_len * micro_batch * arch.hidden
    score_terms = 5 * arch.heads * seq_len * seq_len * micro_batch if store_scores else 0
    return linear_terms + score_terms


def activation_bytes(arch: Architecture, inputs: ActivationInputs) -> int:
    """Peak activation bytes of all layers for one micro-batch (Korthikanti et al. 2022).

    >>> arch = Architecture(layers=32, hidden=4096, heads=32, vocab=32000)
    >>> activation_bytes(arch, ActivationInputs(1, 4096, "full")) / 2**30
    1.53125
    """
    mode = check_checkpointing(inputs.checkpointing)
    b, s = inputs.micro_batch, inputs.seq_len
    keeps_scores = not inputs.fused_attention
    if mode == "none":
        total = arch.layers * layer_activation_bytes(arch, b, s, store_scores=keeps_scores)
    elif mode == "selective":
        # Recomputing the attention core means its s×s matrices are never kept.
        total = arch.layers * layer_activation_bytes(arch, b, s, store_scores=False)
    else:
        layer_inputs = arch.layers * 2 * s * b * arch.hidden
        total = layer_inputs + layer_activation_bytes(arch, b, s, store_scores=keeps_scores)
    return 2 * total if inputs.fp32_activations else total


def logits_loss_bytes(vocab: int, micro_batch: int, seq_len: int) -> int:
    """fp32 logits for the cross-entropy loss plus their fp32 gradient: 2 × 4·b·s·V.

    Kept out of the per-layer formula because it scales with the vocabulary, not h,
    and for small models with large vocabularies it dominates.
    """
    return 2 * 4 * micro_batch * seq_len * vocab
