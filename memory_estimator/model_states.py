"""Model-state bytes (parameters, gradients, optimizer states) per rank, per ZeRO stage.

Pure functions only. Notation (ZeRO paper, Rajbhandari et al. 2020): Ψ parameters,
N ranks, p / g / K bytes per parameter for parameters / gradients / optimizer states,
where K includes the fp32 master weights in mixed precision.

Stage semantics per rank:

=============  ==========  ==========  ==========================
plan           params      grads       optimizer states
=============  ==========  ==========  ==========================
ddp (0)        pΨ          gΨ          KΨ
zero1          pΨ          gΨ          KΨ/N
zero2          pΨ          gΨ/N        KΨ/N
zero3          pΨ/N        gΨ/N        KΨ/N
zero3-offload  pΨ/N        gΨ/N        0 on device (KΨ/N on host)
=============  ==========  ==========  ==========================

"Ψ/N" is ``ceil(Ψ/N)`` by default; the engine pads flat buffers to a multiple of N and
may pass the exact per-rank element count as ``shard_numel_per_rank`` instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import EstimatorInputError

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adam8bit")

# Optimizer state bytes per parameter, excluding any fp32 master copy.
# - adam/adamw: exp_avg + exp_avg_sq in fp32.
# - sgd-momentum: one fp32 momentum buffer; plain sgd keeps nothing.
# - adam8bit: two 1-byte quantized moments; the per-block scales (one fp32 per 2048
#   elements in bitsandbytes' blockwise scheme) are < 0.01 B/param and ignored.
# - adafactor: the factored second moment is rows + cols per matrix, not per element,
#   so it is ~0 per parameter; callers that know the shapes add it through
#   ``factored_state_numel`` (see ``model_state_bytes``). No first moment (beta1=None).
_OPTIMIZER_STATE_BYTES = {
    "adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4, "adafactor": 0, "adam8bit": 2,
}
FP32_MASTER_BYTES = 4
PLAN_NAMES = ("ddp", "zero1", "zero2", "zero3", "zero3-offload")


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes one parameter costs in each model-state term (before sharding)."""

    params: int
    grads: int
    optimizer_states: int  # includes the fp32 master copy under mixed precision

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states


@dataclass(frozen=True)
class PlanSpec:
    """Which model states a plan shards across ranks, and whether it offloads."""

    name: str
    stage: int
    offload: bool

    @property
    def shards_optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        return self.stage >= 3


PLANS = (
    PlanSpec("ddp", 0, False),
    PlanSpec("zero1", 1, False),
    PlanSpec("zero2", 2, False),
    PlanSpec("zero3", 3, False),
    PlanSpec("zero3-offload", 3, True),
)


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank model-state bytes of one plan; host bytes are kept apart from device bytes."""

    params: int
    grads: int
    optimizer_states: int
    host_optimizer_states: int = 0

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer_states


def plan_spec(name: str) -> PlanSpec:
    """Look up a plan by name (``"ddp"``, ``"zero1"`` … ``"zero3-offload"``)."""
    for spec in PLANS:
        if spec.name == name:
            return spec
    raise EstimatorInputError(f"unknown plan {name!r}; choose from {', '.join(PLAN_NAMES)}")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise EstimatorInputError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    return precision


def check_optimizer(optimizer: str) -> str:
    if optimizer not in _OPTIMIZER_STATE_BYTES:
        raise EstimatorInputError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    return optimizer


def is_mixed_precision(precision: str) -> bool:
    """bf16/fp16 mean 16-bit params and grads with fp32 master weights and optimizer state."""
    return check_precision(precision) != "fp32"


def bytes_per_param(precision: str, optimizer: str) -> BytesPerParam:
    """Bytes per parameter for params, grads and optimizer states (K incl. master).

    >>> bytes_per_param("bf16", "adamw")
    BytesPerParam(params=2, grads=2, optimizer_states=12)
    >>> bytes_per_param("fp32", "adamw")
    BytesPerParam(params=4, grads=4, optimizer_states=8)
    """
    state = _OPTIMIZER_STATE_BYTES[check_optimizer(optimizer)]
    if is_mixed_precision(precision):
        return BytesPerParam(params=2, grads=2, optimizer_states=FP32_MASTER_BYTES + state)
    return BytesPerParam(params=4, grads=4, optimizer_states=state)


def shard_numel(num_params: int, world_size: int) -> int:
    """Elements one rank owns when Ψ is split evenly with padding: ``ceil(Ψ/N)``."""
    return math.ceil(num_params / world_size)


def model_state_bytes(
    plan: PlanSpec,
    num_params: int,
    world_size: int,
    per_param: BytesPerParam,
    *,
    shard_numel_per_rank: int | None = None,
    extra_optimizer_state_bytes: int = 0,
) -> ModelStateBytes:
    """Per-rank bytes of params / grads / optimizer states for one plan.

    ``extra_optimizer_state_bytes`` is unsharded optimizer state not proportional to Ψ
    (Adafactor's factored row/column statistics); it is sharded like the other states.

    ZeRO paper check, Ψ = 7.5e9, N = 64, mixed-precision Adam:

    >>> bpp = bytes_per_param("fp16", "adam")
    >>> [model_state_bytes(p, 7_500_000_000, 64, bpp).device_total / 1e9 for p in PLANS[:4]]
    [120.0, 31.40625, 16.640625, 1.875]
    """
    sharded = shard_numel(num_params, world_size) if shard_numel_per_rank is None else shard_numel_per_rank
    extra_sharded = math.ceil(extra_optimizer_state_bytes / world_size)

    params_numel = sharded if plan.shards_params else num_params
    grads_numel = sharded if plan.shards_grads else num_params
    if plan.shards_optimizer:
        optimizer = sharded * per_param.optimizer_states + extra_sharded
    else:
        optimizer = num_params * per_param.optimizer_states + extra_optimizer_state_bytes
    device_optimizer, host_optimizer = (0, optimizer) if plan.offload else (optimizer, 0)
    return ModelStateBytes(
        params=params_numel * per_param.params,
        grads=grads_numel * per_param.grads,
        optimizer_states=device_optimizer,
        host_optimizer_states=host_optimizer,
    )
