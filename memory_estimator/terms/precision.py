"""Precision policies: which dtype each training tensor is held in, per element.

======================  ======  =====  ======  =================  ===================================
name                    params  grads  master  optimizer states   what trains this way
======================  ======  =====  ======  =================  ===================================
``fp32``                4       4      0       fp32               plain fp32 training
``bf16`` / ``fp16``     2       2      4       fp32               mixed precision with fp32 masters
                                                                  (ZeRO, DeepSpeed, shardengine's
                                                                  ``param_dtype``)
``pure-bf16`` /         2       2      0       bf16 / fp16        the model itself in 16 bits, no
``pure-fp16``                                                     master (torchtune's and
                                                                  llama-recipes' ``pure_bf16``;
                                                                  shardengine given a bf16 model
                                                                  without ``param_dtype``)
======================  ======  =====  ======  =================  ===================================

torch autocast (``--amp fp16|bf16``) is not a precision of the weights: they stay fp32
(4 + 4 + fp32 states, no master) and autocast adds a low-precision copy of each fp32 weight
(its cast cache, kept for backward; a frozen base stored in 16 bits is not cast) and runs
norms, softmax and the loss in fp32; see ``amp_weight_cache_bytes``, ``finetune.py``'s
``autocast_cast_numel`` and ``activations.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import EstimatorInputError

PRECISIONS = ("fp32", "bf16", "fp16", "pure-bf16", "pure-fp16")
AMP_DTYPES = ("fp16", "bf16")
FP32_BYTES = 4


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each model-state tensor and of the saved activations."""

    name: str
    param_bytes: int        # the weights forward and backward read
    grad_bytes: int         # gradients as the engine holds and reduces them
    master_bytes: int       # a separate fp32 master copy (0: the optimizer steps the weights)
    state_bytes: int        # one optimizer-state element (exp_avg, momentum, ...)
    activation_bytes: int   # saved activations and the compute-dtype logits
    amp: str | None = None  # "fp16"/"bf16": torch autocast over fp32 weights

    @property
    def mixed(self) -> bool:
        """fp32 masters beside 16-bit weights (the ZeRO paper's K = 12 for Adam)."""
        return self.master_bytes > 0

    @property
    def low_precision_states(self) -> bool:
        return self.state_bytes < FP32_BYTES


_POLICIES = {
    "fp32": Precision("fp32", 4, 4, 0, 4, 4),
    "bf16": Precision("bf16", 2, 2, 4, 4, 2),
    "fp16": Precision("fp16", 2, 2, 4, 4, 2),
    "pure-bf16": Precision("pure-bf16", 2, 2, 0, 2, 2),
    "pure-fp16": Precision("pure-fp16", 2, 2, 0, 2, 2),
}


def check_precision(name: str) -> str:
    if name not in _POLICIES:
        raise EstimatorInputError(f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)}")
    return name


def check_amp(amp: str | None) -> str | None:
    if amp is not None and amp not in AMP_DTYPES:
        raise EstimatorInputError(f"unknown autocast dtype {amp!r}; choose from {', '.join(AMP_DTYPES)}")
    return amp


def precision_policy(name: str, amp: str | None = None) -> Precision:
    """The policy for a precision name, with autocast on top when ``amp`` is given.

    >>> precision_policy("pure-bf16").state_bytes
    2
    >>> p = precision_policy("fp32", amp="bf16"); (p.param_bytes, p.activation_bytes)
    (4, 2)
    """
    policy = _POLICIES[check_precision(name)]
    if check_amp(amp) is None:
        return policy
    if name != "fp32":
        raise EstimatorInputError(f"autocast (amp={amp}) runs over fp32 weights; it cannot be combined with "
                                  f"precision {name!r} (leave precision at fp32)")
    return Precision(f"amp-{amp}", 4, 4, 0, 4, 2, amp=amp)


def amp_weight_cache_bytes(policy: Precision, cast_params: int) -> int:
    """Autocast's low-precision copy of the fp32 weights used in forward.

    torch autocast caches the cast of each leaf tensor that requires grad for as long
    as the autocast region is open (``cached_casts`` in ``aten/src/ATen/autocast_mode.cpp``),
    and the matmuls save those copies for backward, so one low-precision copy of the
    weights is alive from the end of forward until each layer's backward has run.
    ``cast_params``: the weights autocast casts (``finetune.autocast_cast_numel``: a base
    already stored in 16 bits is not cast at all).

    >>> amp = precision_policy("fp32", amp="bf16")
    >>> amp_weight_cache_bytes(amp, 1000), amp_weight_cache_bytes(precision_policy("bf16"), 1000)
    (2000, 0)
    """
    return 2 * cast_params if policy.amp else 0
