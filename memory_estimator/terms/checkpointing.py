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

The vocabulary and its parsing are the engine's own (``shardengine/activation_rules.py``,
pure code the engine applies with ``activation_checkpointing=``), so the two cannot drift.
"""
from __future__ import annotations

from shardengine.engine_facts import CHECKPOINT_MODES, CheckpointRule, parse_checkpoint

from ..errors import EstimatorInputError

CHECKPOINTING_MODES = CHECKPOINT_MODES
CheckpointPolicy = CheckpointRule  # the estimator's name for the engine's rule


def parse_policy(text: str) -> CheckpointPolicy:
    """``"none"``, ``"full"``, ``"every-k:2"``, ``"selective:mm/2"``, ... as a policy.

    >>> parse_policy("every-k:2")
    CheckpointRule(kind='full', every=2, mm_stride=1, mm_offset=0)
    >>> parse_policy("selective:op").mm_stride
    2
    """
    return parse_checkpoint(text, EstimatorInputError)


def check_checkpointing(mode: str) -> str:
    parse_policy(mode)
    return mode
