"""Activation checkpointing policies as rules on which tensors a layer keeps.

========================  =================================================================
policy                    what each layer keeps for backward (per token; see activations.py)
========================  =================================================================
``none``                  everything: ``full``
``selective``             Korthikanti et al.'s selective recomputation: everything but the
                          attention core's s×s matrices (same as ``none`` with fused attention)
``full``                  only its input (c·h, fp32 under autocast); backward recomputes one
                          layer at a time, adding ``full - input`` while it does
``every-k:K``             ``full`` checkpointing on every K-th layer (``ceil(L/K)`` of them),
                          nothing on the others (torchtitan's selective *layer* AC)
``selective:mm``          its input, the output of every matmul (q, k, v, o, MLP projections)
                          and of the attention kernel; norms, activations and element-wise
                          ops are recomputed
``selective:mm/2``        as ``selective:mm`` but only every second matmul's output (the 1st,
(alias ``selective:op``)  3rd, ...), as torchtitan's selective *op* AC policy saves them
========================  =================================================================

A checkpointed layer recomputes in backward after the loss's logits buffers are
freed, so the recompute extra and the logits are never counted at the same moment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import EstimatorInputError

CHECKPOINTING_MODES = ("none", "selective", "full", "every-k:K", "selective:mm", "selective:mm/2",
                       "selective:op")
_FIXED = {"none": "none", "selective": "selective", "full": "full"}


@dataclass(frozen=True)
class CheckpointPolicy:
    """A parsed policy: what checkpointed layers keep and how many layers are checkpointed."""

    kind: str              # "none", "selective", "full" or "mm"
    every: int = 1         # checkpoint every ``every``-th layer
    mm_stride: int = 1     # "mm": keep every ``mm_stride``-th matmul output
    mm_offset: int = 0

    @property
    def keeps_attention_scores(self) -> bool:
        return self.kind == "none"

    def checkpointed_layers(self, layers: int) -> int:
        """Layers whose activations follow the policy (the rest keep everything)."""
        if self.kind == "none":
            return 0
        return math.ceil(layers / self.every)


def parse_policy(text: str) -> CheckpointPolicy:
    """``"none"``, ``"full"``, ``"every-k:2"``, ``"selective:mm/2"``, ... as a policy.

    >>> parse_policy("every-k:2")
    CheckpointPolicy(kind='full', every=2, mm_stride=1, mm_offset=0)
    >>> parse_policy("selective:op").mm_stride
    2
    """
    if not isinstance(text, str):
        raise EstimatorInputError(f"checkpointing must be a string such as 'full', got {text!r}")
    if text in _FIXED:
        return CheckpointPolicy(_FIXED[text])
    if text.startswith("every-k:"):
        every = text.partition(":")[2]
        if not every.isdigit() or int(every) < 1:
            raise EstimatorInputError(f"checkpointing {text!r}: K must be a whole number >= 1, e.g. every-k:2")
        return CheckpointPolicy("full", every=int(every))
    if text in ("selective:mm", "selective:mm/1"):
        return CheckpointPolicy("mm")
    if text in ("selective:mm/2", "selective:op"):
        return CheckpointPolicy("mm", mm_stride=2)
    raise EstimatorInputError(
        f"unknown checkpointing {text!r}; choose from none, selective, full, every-k:K, selective:mm, "
        "selective:mm/2 (alias selective:op)")


def check_checkpointing(mode: str) -> str:
    parse_policy(mode)
    return mode
