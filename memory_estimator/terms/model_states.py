"""Model-state bytes (parameters, gradients, optimizer states) per rank, per ZeRO stage.

Pure functions only. Notation (ZeRO paper, Rajbhandari et al. 2020): Ψ parameters,
N ranks, p / g / K bytes per parameter for parameters / gradients / optimizer states,
where K includes the fp32 master weights in mixed precision.

Stage semantics per rank:

====================  ==========  ==========  ==========================
plan                  params      grads       optimizer states
====================  ==========  ==========  ==========================
ddp (0)               pΨ          gΨ          KΨ
zero1                 pΨ          gΨ          KΨ/N
zero2                 pΨ          gΨ/N        KΨ/N
zero3                 pΨ/N        gΨ/N        KΨ/N
zero3-offload         pΨ/N        gΨ/N        0 on device (KΨ/N on host)
zero3-offload-params  0 (pΨ/N     0 (gΨ/N     0 on device (KΨ/N on host)
                      on host)    on host)
====================  ==========  ==========  ==========================

"Ψ/N" is ``ceil(Ψ/N)`` by default; the engine pads flat buffers to a multiple of N and
may pass the exact per-rank element count as ``shard_numel_per_rank`` instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import EstimatorInputError
from .optimizers import check_optimizer, state_bytes_per_element
from .precision import precision_policy

# Kept for callers that import them from here; the policies live in precision.py and
# optimizers.py.
FP32_MASTER_BYTES = 4


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
    offload: bool                 # optimizer states (and fp32 masters) on the host
    offload_params: bool = False  # parameters on the host too (ZeRO-Infinity, FSDP2 CPUOffloadPolicy)
    # shardengine's fractional offload (Offload(params=f) / Offload(device_budget=b)): the units
    # that shardengine.flat.residency moves hold zero3-offload-params' states, the others zero3's
    params_fraction: float | None = None
    device_budget: int | None = None
    disk: bool = False            # what offload moves goes to files instead (the gradients stay on the host)

    @property
    def partial_params(self) -> bool:
        """Some units' states on the host, the others on the device (see :func:`partial_plan`)."""
        return self.params_fraction is not None or self.device_budget is not None

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
    PlanSpec("zero3-offload-params", 3, True, offload_params=True),
    PlanSpec("zero2-offload", 2, True),   # ZeRO-Offload (DeepSpeed stage 2 + offload_optimizer)
    # shardengine's disk tier (Offload(optimizer="disk") / Offload(params="disk")), planned on request
    PlanSpec("zero3-offload-disk", 3, True, disk=True),
    PlanSpec("zero3-offload-params-disk", 3, True, offload_params=True, disk=True),
)
PLAN_NAMES = tuple(plan.name for plan in PLANS)


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank model-state bytes of one plan; host bytes are kept apart from device bytes."""

    params: int
    grads: int
    optimizer_states: int
    host_optimizer_states: int = 0
    host_params: int = 0
    host_grads: int = 0

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def host_total(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer_states


PARTIAL_PREFIX = "zero3-offload-params-"


def partial_plan(fraction: float | None = None, budget: int | None = None) -> PlanSpec:
    """shardengine's stage 3 with ``fraction`` of the parameters (or what does not fit ``budget``
    device bytes) on the host, named after it.

    >>> partial_plan(0.5).name, plan_spec("zero3-offload-params-budget-1024B").device_budget
    ('zero3-offload-params-0.5', 1024)
    """
    if (fraction is None) == (budget is None):
        raise EstimatorInputError("a fractional offload plan takes a fraction or a device budget, not both")
    if fraction is not None and not 0 < fraction < 1:
        raise EstimatorInputError(f"the fraction of the parameters on the host must be > 0 and < 1 (1 is "
                                  f"zero3-offload-params), got {fraction!r}")
    if budget is not None and budget < 0:
        raise EstimatorInputError(f"the device budget must be >= 0 bytes, got {budget!r}")
    name = PARTIAL_PREFIX + (f"{fraction:g}" if fraction is not None else f"budget-{budget}B")
    return PlanSpec(name, 3, False, params_fraction=fraction, device_budget=budget)


def plan_spec(name: str) -> PlanSpec:
    """Look up a plan by name (``"ddp"``, ``"zero1"`` … ``"zero3-offload"``, a :func:`partial_plan`'s)."""
    for spec in PLANS:
        if spec.name == name:
            return spec
    if name.startswith(PARTIAL_PREFIX):
        rest = name[len(PARTIAL_PREFIX):]
        try:
            if rest.startswith("budget-") and rest.endswith("B"):
                return partial_plan(budget=int(rest[len("budget-"):-1]))
            return partial_plan(float(rest))
        except ValueError:
            pass
    raise EstimatorInputError(f"unknown plan {name!r}; choose from {', '.join(PLAN_NAMES)}")


def is_mixed_precision(precision: str) -> bool:
    """bf16/fp16 mean 16-bit params and grads with fp32 master weights and optimizer state."""
    return precision_policy(precision).mixed


def bytes_per_param(precision: str, optimizer: str) -> BytesPerParam:
    """Bytes per parameter for params, grads and optimizer states (K incl. master).

    >>> bytes_per_param("bf16", "adamw")
    BytesPerParam(params=2, grads=2, optimizer_states=12)
    >>> bytes_per_param("fp32", "adamw")
    BytesPerParam(params=4, grads=4, optimizer_states=8)
    >>> bytes_per_param("pure-bf16", "adamw")
    BytesPerParam(params=2, grads=2, optimizer_states=4)
    """
    policy = precision_policy(precision)
    state = state_bytes_per_element(check_optimizer(optimizer), policy.state_bytes)
    return BytesPerParam(params=policy.param_bytes, grads=policy.grad_bytes,
                         optimizer_states=policy.master_bytes + state)


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
    params, grads = params_numel * per_param.params, grads_numel * per_param.grads
    if plan.offload_params:  # parameters, gradients and the step all live on the host
        return ModelStateBytes(0, 0, 0, host_optimizer_states=optimizer, host_params=params, host_grads=grads)
    if plan.offload:
        return ModelStateBytes(params, grads, 0, host_optimizer_states=optimizer)
    return ModelStateBytes(params, grads, optimizer)
