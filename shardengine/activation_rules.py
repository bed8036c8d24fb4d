"""What an activation policy says, as pure rules the engine and the estimator share.

The checkpointing vocabulary is the memory estimator's (``--checkpointing``), parsed
here once so the two cannot drift:

========================  =================================================================
policy                    what each block (a stage-3 unit; at stages 0-2 the same modules)
                          keeps for backward
========================  =================================================================
``none``                  everything autograd saves
``selective``             Korthikanti et al.'s selective recomputation: everything but the
                          attention core's s×s matrices, which backward recomputes (with
                          fused attention, SDPA or flash, nothing s×s is saved: ``none``)
``full``                  only its input (torch's non-reentrant checkpoint of the block)
``every-k:K``             ``full`` on every K-th block (blocks 0, K, 2K, ...; ``ceil(L/K)``
                          of them), nothing on the others (torchtitan's selective *layer* AC)
``selective:mm``          its input and the output of every matmul (mm, addmm, bmm) and
                          attention kernel; element-wise work is recomputed (torch's
                          selective-checkpoint contexts)
``selective:mm/2``        as ``selective:mm`` but only every second matmul's output (the 1st,
(alias ``selective:op``)  3rd, ...; attention kernels always), as torchtitan's op AC saves them
========================  =================================================================

Activation offload moves what a block saves to host memory as forward saves it
(torchtune's ``OffloadActivations``). ``offload`` names the blocks: True is every
block but the last (its tensors are the first backward needs), an int ``n`` the first
``n`` blocks, a fraction ``f`` in (0, 1) the first ``floor(f * L)``; the last block
always stays. The first blocks are chosen because their tensors wait longest for
backward.

>>> rule = parse_checkpoint("every-k:2")
>>> rule, [rule.checkpoints(i) for i in range(4)]
(CheckpointRule(kind='full', every=2, mm_stride=1, mm_offset=0), [True, False, True, False])
>>> offloaded_blocks(True, 4), offloaded_blocks(0.5, 4), offloaded_blocks(9, 4)
([True, True, True, False], [True, True, False, False], [True, True, True, False])
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Union

import torch
from torch import nn

CHECKPOINT_MODES = ("none", "selective", "full", "every-k:K", "selective:mm", "selective:mm/2",
                    "selective:op")
_FIXED = ("none", "selective", "full")

OffloadValue = Union[bool, int, float]


@dataclass(frozen=True)
class CheckpointRule:
    """A parsed checkpointing policy: what a checkpointed block keeps, and which blocks are."""

    kind: str              # "none", "selective", "full" or "mm"
    every: int = 1         # checkpoint every ``every``-th block (0, every, 2*every, ...)
    mm_stride: int = 1     # "mm": keep every ``mm_stride``-th matmul output ...
    mm_offset: int = 0     # ... starting at this one

    @property
    def keeps_attention_scores(self) -> bool:
        return self.kind == "none"

    def checkpointed_layers(self, layers: int) -> int:
        """Blocks whose activations follow the policy (the rest keep everything)."""
        if self.kind == "none":
            return 0
        return math.ceil(layers / self.every)

    def checkpoints(self, index: int) -> bool:
        """Block ``index`` (0-based, in the model's order) follows the policy."""
        return self.kind != "none" and index % self.every == 0

    def saves_matmul(self, count: int) -> bool:
        """``selective:mm``: the ``count``-th matmul (1-based) of a block keeps its output."""
        return count > self.mm_offset and (count - 1 - self.mm_offset) % self.mm_stride == 0


def parse_checkpoint(text: object, error: type[Exception] = ValueError) -> CheckpointRule:
    """``"none"``, ``"full"``, ``"every-k:2"``, ``"selective:mm/2"``, ... as a rule; anything
    else raises ``error`` (the caller's ``ConfigError`` or ``EstimatorInputError``) naming the
    choices.

    >>> parse_checkpoint("selective:op").mm_stride
    2
    >>> parse_checkpoint("every-k:0")
    Traceback (most recent call last):
    ...
    ValueError: checkpointing 'every-k:0': K must be a whole number >= 1, e.g. every-k:2
    """
    if not isinstance(text, str):
        raise error(f"checkpointing must be a string such as 'full', got {text!r}")
    if text in _FIXED:
        return CheckpointRule(text)
    if text.startswith("every-k:"):
        every = text.partition(":")[2]
        if not every.isdigit() or int(every) < 1:
            raise error(f"checkpointing {text!r}: K must be a whole number >= 1, e.g. every-k:2")
        return CheckpointRule("full", every=int(every))
    if text in ("selective:mm", "selective:mm/1"):
        return CheckpointRule("mm")
    if text in ("selective:mm/2", "selective:op"):
        return CheckpointRule("mm", mm_stride=2)
    raise error(f"unknown checkpointing {text!r}; choose from none, selective, full, every-k:K, "
                "selective:mm, selective:mm/2 (alias selective:op)")


def check_offload(value: object, error: type[Exception] = ValueError) -> OffloadValue:
    """``offload`` normalised: False, True, an int >= 1 (blocks) or a float in (0, 1) (a share)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value >= 1:
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and 0 < value < 1:
        return float(value)
    raise error(f"activation offload must be True, False, a number of blocks >= 1 or a fraction of "
                f"the blocks in (0, 1), got {value!r}")


def offloaded_blocks(offload: OffloadValue, blocks: int) -> list[bool]:
    """Per block, in the model's order: are its saved tensors moved to the host?"""
    if offload is True:
        count = blocks - 1
    elif offload is False:
        count = 0
    elif isinstance(offload, float):
        count = math.floor(offload * blocks)
    else:
        count = offload
    count = max(0, min(count, blocks - 1))
    return [index < count for index in range(blocks)]


# [Note: what offload copies] activations/offload.py applies it, the estimator's trace prices it
# (memory_estimator/model/traced_blocks.py): torchtune's threshold, and never a parameter (the
# engine's flat buffers are not activations) or a non-dense view (an expanded mask would be
# materialized).
MIN_OFFLOAD_BYTES = 1024


def is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` saved by a Linear): never an activation."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def is_dense(tensor: torch.Tensor) -> bool:
    """Its elements fill a block of memory exactly once, in some order of the dimensions (so a
    copy with the same strides holds just them: not an ``expand``, not a strided slice)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(tensor.size(), tensor.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def copied_to_host(tensor: torch.Tensor) -> bool:
    """Whether activation offload copies this saved tensor to the host (see the Note)."""
    return (not is_parameter(tensor) and tensor.numel() * tensor.element_size() >= MIN_OFFLOAD_BYTES
            and is_dense(tensor))
