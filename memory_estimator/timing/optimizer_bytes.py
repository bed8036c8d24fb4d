"""Bytes the optimizer step reads and writes per stepped element (it is memory-bound)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .inputs import Workload

# Bytes an element-wise step reads and writes per element (fp32 state): Adam reads
# param, grad, exp_avg, exp_avg_sq and writes param and both moments (28); SGD with
# momentum 20, plain SGD 12, Adafactor ~16 (factored second moment), 8-bit Adam 16.
# Mixed precision adds the fp32 master gradient written and read again (+8).
STEP_BYTES = {"adamw": 28, "adam": 28, "sgd": 12, "sgd-momentum": 20, "adafactor": 16, "adam8bit": 16,
              "paged-adamw8bit": 16, "paged-adamw": 28, "muon": 20, "muon-adamw": 20}
MIXED_PRECISION_STEP_BYTES = 8
# bitsandbytes keeps 32-bit optimizer state whatever the parameters' dtype (optim_bits=32)
FP32_STATE_OPTIMIZERS = ("paged-adamw",)


def step_bytes_per_element(workload: "Workload") -> float:
    """Bytes the optimizer step reads and writes per stepped element. ``STEP_BYTES`` counts
    fp32 tensors; mixed precision adds the fp32 master gradient; a pure 16-bit model
    (``pure-bf16``) steps 16-bit parameters, gradients and states: half the bytes, or, where
    the state stays fp32, 6 fewer (parameter read and write, gradient read in 2 bytes)."""
    per_element = STEP_BYTES[workload.optimizer]
    if workload.precision.startswith("pure-"):
        return per_element - 6 if workload.optimizer in FP32_STATE_OPTIMIZERS else per_element / 2
    return per_element + (0 if workload.precision == "fp32" else MIXED_PRECISION_STEP_BYTES)


__all__ = ["STEP_BYTES", "MIXED_PRECISION_STEP_BYTES", "step_bytes_per_element"]
