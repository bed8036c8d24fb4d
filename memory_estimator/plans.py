"""Per-plan byte accounting, the fit verdict, and what to change when nothing fits.

Everything here is a pure function of the model facts, the training setup, the device
and an activation function ``micro_batch -> bytes``; the public ``estimate`` wires
them together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from .devices import Device
from .engine_plan import EngineModel
from .model_states import PLANS, BytesPerParam, PlanSpec, bytes_per_param, model_state_bytes
from .stats import ModelStats
from .units import MiB

# Searches for a micro-batch or a world size stop here: beyond it the answer is "no".
SEARCH_LIMIT = 1 << 20


@dataclass(frozen=True)
class Overheads:
    """Memory that is neither model state nor activations, each term configurable.

    - ``cuda_context_bytes``: CUDA context, cuBLAS/cuDNN/NCCL workspaces, loaded kernels;
      measured at 0.3–0.8 GiB per process on A100/H100 with recent PyTorch. 512 MiB.
    - ``fragmentation_fraction``: caching-allocator rounding and fragmentation, charged
      on model states + activations + working set + logits. 5%.
    - ``logits_in_overhead``: count the fp32 logits and their gradient (2·4·b·s·V) when
      the vocabulary is known. Traced estimates already include them.
    """

    cuda_context_bytes: int = 512 * MiB
    fragmentation_fraction: float = 0.05
    logits_in_overhead: bool = True


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained; everything that changes bytes but is not the model."""

    world_size: int = 1
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_len: int = 2048
    checkpointing: str = "none"
    fused_attention: bool = True
    prefetch_depth: int = 1            # stage 3: units gathered ahead of the running one
    bucket_bytes: int = 25 * MiB       # gradient reduce / parameter gather bucket
    safety_margin: float = 0.10        # fraction of device memory kept free
    shard_numel_per_rank: int | None = None  # exact engine shard size; default ceil(Ψ/N)


@dataclass(frozen=True)
class PlanEstimate:
    """One plan's per-rank bytes, term by term, and its verdict on the device."""

    name: str
    stage: int
    offload: bool
    params: int
    grads: int
    optimizer_states: int
    activations: int
    working_set: int
    overhead: int
    fits: bool
    headroom: int                    # usable bytes left over; negative when it does not fit
    host_optimizer_states: int = 0   # optimizer states (incl. master) held in CPU RAM

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer_states + self.activations
                + self.working_set + self.overhead)

    def to_json_dict(self) -> dict:
        terms = ("params", "grads", "optimizer_states", "activations", "working_set", "overhead")
        per_rank = {term: int(getattr(self, term)) for term in terms}
        per_rank["total"] = int(self.total)
        return {"name": self.name, "stage": self.stage, "offload": self.offload,
                "per_rank_bytes": per_rank, "fits": self.fits}


ActivationFn = Callable[[int, TrainingSetup], int]
LogitsFn = Callable[[int, TrainingSetup], int]


def usable_bytes(device: Device, safety_margin: float) -> int:
    """Device memory minus the safety margin: the budget a plan's total must fit in."""
    return int(device.memory_bytes * (1.0 - safety_margin))


def working_set_bytes(plan: PlanSpec, stats: ModelStats, setup: TrainingSetup, per_param: BytesPerParam) -> int:
    """Transient buffers beyond the sharded states.

    Stages 0–2: one gradient bucket being reduced. Stage 3: the full parameters of the
    live units (the running one plus ``prefetch_depth`` gathered ahead) plus the bucket.
    Without a known unit size the whole model is one unit, the no-wrapping worst case.
    """
    if not plan.shards_params:
        return setup.bucket_bytes
    unit = stats.largest_unit if stats.largest_unit is not None else stats.params
    # Prefetch cannot hold more units than the model has (a one-unit model gathers once).
    live_units = min(1 + setup.prefetch_depth, math.ceil(stats.params / unit))
    return unit * per_param.params * live_units + setup.bucket_bytes


def plan_estimate(
    plan: PlanSpec,
    stats: ModelStats,
    setup: TrainingSetup,
    device: Device,
    activations: ActivationFn,
    logits: LogitsFn,
    overheads: Overheads,
    engine: EngineModel | None = None,
) -> PlanEstimate:
    """Every per-rank term of one plan and whether the sum fits under the safety margin.

    With ``engine`` (a module planned by shardengine's own planner, at this world size)
    the model states are the engine's exact bytes and the working set follows its buffers.
    """
    activation = activations(setup.micro_batch, setup)
    if engine is not None and engine.applies(setup.world_size):
        states = engine.states(plan, setup.precision, setup.optimizer)
        working = engine.working_set(plan, setup.precision, setup.optimizer, activation, setup.prefetch_depth)
    else:
        per_param = bytes_per_param(setup.precision, setup.optimizer)
        factored_bytes = 4 * stats.factored_state_numel if setup.optimizer == "adafactor" else 0
        states = model_state_bytes(plan, stats.params, setup.world_size, per_param,
                                   shard_numel_per_rank=setup.shard_numel_per_rank,
                                   extra_optimizer_state_bytes=factored_bytes)
        working = working_set_bytes(plan, stats, setup, per_param)
    logit_bytes = logits(setup.micro_batch, setup) if overheads.logits_in_overhead else 0
    dynamic = states.device_total + activation + working + logit_bytes
    overhead = overheads.cuda_context_bytes + logit_bytes + math.ceil(overheads.fragmentation_fraction * dynamic)
    total = states.device_total + activation + working + overhead
    headroom = usable_bytes(device, setup.safety_margin) - total
    return PlanEstimate(plan.name, plan.stage, plan.offload, states.params, states.grads,
                        states.optimizer_states, activation, working, overhead,
                        fits=headroom >= 0, headroom=headroom,
                        host_optimizer_states=states.host_optimizer_states)


def all_plans(stats, setup, device, activations, logits, overheads, engine=None) -> tuple[PlanEstimate, ...]:
    return tuple(plan_estimate(p, stats, setup, device, activations, logits, overheads, engine) for p in PLANS)


def least_sharded_fit(plans: tuple[PlanEstimate, ...]) -> PlanEstimate | None:
    """PLANS is ordered by communication cost, so the first plan that fits is the cheapest."""
    return next((plan for plan in plans if plan.fits), None)


def largest_fitting(fits: Callable[[int], bool], low: int, limit: int = SEARCH_LIMIT) -> int | None:
    """Largest x in [low, limit] with fits(x), for a monotone (fits, then not) predicate.

    Doubles from ``low`` to bracket the boundary, then bisects: O(log limit) calls.
    """
    if not fits(low):
        return None
    good, bad = low, None
    while bad is None:
        candidate = min(good * 2, limit)
        if candidate == good:
            return good
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def smallest_fitting(fits: Callable[[int], bool], low: int, limit: int = SEARCH_LIMIT) -> int | None:
    """Smallest x in [low, limit] with fits(x), for a monotone (not, then fits) predicate.

    One past the largest x that does not fit: the same search on the negated predicate.
    """
    last_miss = largest_fitting(lambda x: not fits(x), low, limit)
    if last_miss is None:
        return low
    return last_miss + 1 if last_miss < limit else None


def plan_fits_with(plan: PlanSpec, stats, setup, device, activations, logits, overheads, engine=None) -> bool:
    return plan_estimate(plan, stats, setup, device, activations, logits, overheads, engine).fits


def _min_world_size(plan: PlanSpec, stats, setup, device, activations, logits, overheads) -> int | None:
    # A shard's exact size is known to the engine only for the current N; let it vary here.
    n_fits = lambda n: plan_fits_with(plan, stats, replace(setup, world_size=n, shard_numel_per_rank=None),
                                      device, activations, logits, overheads)
    return smallest_fitting(n_fits, setup.world_size)


def _advice_for(label: str, candidate: TrainingSetup, stats, device, activations, logits, overheads,
                engine=None) -> list[str]:
    """What fits under one changed setup: a plan at the current N, else the N stage 3 needs."""
    fitting = least_sharded_fit(all_plans(stats, candidate, device, activations, logits, overheads, engine))
    if fitting is not None:
        return [f"{label}: {fitting.name} fits at world size {candidate.world_size}"]
    advice = []
    for plan in PLANS[3:]:
        minimum = _min_world_size(plan, stats, candidate, device, activations, logits, overheads)
        if minimum is not None:
            advice.append(f"{label}: {plan.name} fits with world size >= {minimum}")
    return advice


def suggestions(stats, setup, device, activations, logits, overheads, engine=None) -> tuple[str, ...]:
    """What would make training fit when no plan does: more GPUs, a smaller micro-batch,
    full activation checkpointing, offload — alone first, then combined."""
    full = replace(setup, checkpointing="full")
    candidates = [("as requested", setup)]
    if setup.micro_batch > 1:
        b_fits = lambda b: least_sharded_fit(all_plans(stats, replace(setup, micro_batch=b), device,
                                                       activations, logits, overheads, engine)) is not None
        smaller = largest_fitting(b_fits, 1, limit=setup.micro_batch - 1)
        candidates.append((f"micro-batch {smaller or 1}", replace(setup, micro_batch=smaller or 1)))
    if setup.checkpointing != "full":
        candidates.append(("full checkpointing", full))
        if setup.micro_batch > 1:
            candidates.append(("full checkpointing and micro-batch 1", replace(full, micro_batch=1)))
    advice = []
    for label, candidate in candidates:
        advice += _advice_for(label, candidate, stats, device, activations, logits, overheads, engine)
    if not advice:
        advice.append("nothing tried fits (more GPUs, micro-batch 1, full checkpointing, offload): the part "
                      "that does not shrink with N (activations, gathered units, overheads) exceeds a rank's "
                      "memory; shorten the sequence, give --largest-layer, or use a larger device")
    return tuple(advice)
