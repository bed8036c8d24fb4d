"""shardengine, analytically: the ZeRO formulas with this project's buffers.

Used for counts and configs; a module input is planned exactly instead
(``engine_plan.py``, the engine's own bucket planner, padding included).

- States (``model_states.py``): p·Ψ params, g·Ψ grads and (master + K)·Ψ optimizer
  states, sharded by stage; at stage 3 no p·Ψ/N beside a separate master (gathers cast it). Offload keeps a separate fp32 master on the host and the
  optimizer state over it in fp32 (``FlatBucket.make_master(separate=True)``), whatever
  the compute dtype; ``zero3-offload-params`` keeps the gradient shards there too (the
  master being the parameter shard, the device holds no model states). Gradients are flat buffers held all the time.
- With the activations: the gradient bucket being filled (stages 0-2); stage 3 also
  the gathered units, the running one plus ``prefetch`` ahead (with
  ``reshard_after_forward=False``, every unit: p·Ψ).
- At the step: the fp32 copy of each stepped gradient under mixed precision
  (``FlatBucket.master_grad``) and the optimizer's own temporaries; none with offload,
  whose step runs on the host. torch's optimizers are stepped one flat bucket at a time
  (stage 3: one unit's shard), so both are one bucket's worth; others over the whole shard.
"""
from __future__ import annotations

import math
from dataclasses import replace

from shardengine.engine_facts import STEP_GROUP_BYTES

from ..errors import EstimatorInputError
from ..terms.model_states import (PLANS, BytesPerParam, ModelStateBytes, PlanSpec, model_state_bytes, partial_plan,
                                  plan_spec)
from ..byte_units import parse_bytes
from ..terms.optimizers import ELEMENTWISE, STEPPED_BY_BUCKET, step_temporary_bytes
from ..terms.precision import FP32_BYTES
from .base import EngineContext, EngineTerms, nonzero


class ShardEngine:
    """The plans shardengine runs: stages 0-3, stage 3 with the optimizer offloaded, and with the
    parameters too (``Offload(params=True)``: shards, reduced gradients, master and step on the host).

    ``disk``: the disk tier's two plans as well, ``zero3-offload-disk`` (``Offload(optimizer="disk")``:
    master and optimizer state in files) and ``zero3-offload-params-disk`` (``Offload(params="disk")``:
    the parameter shards too; the reduced gradients wait on the host). They need a drive and a
    path, so they are planned only when asked for (``--offload disk``).
    """

    name = "shardengine"
    hybrid_stages: tuple[int, ...] = (1, 2, 3)  # shard(shard_group_size=k) at stages 1-3

    def __init__(self, *, disk: bool = False, partial: tuple[PlanSpec, ...] = ()):
        """``partial``: fractional offload plans (``partial_plan``) planned beside the others."""
        self.plans = tuple(plan for plan in PLANS if plan.name != "zero2-offload" and (disk or not plan.disk)) \
            + tuple(partial)

    @staticmethod
    def steps_in_backward(plan: PlanSpec) -> bool:
        """``shard(step_in_backward=True)`` runs this plan (stages 1-3, nothing offloaded)."""
        return plan.stage >= 1 and not plan.offload and not plan.partial_params

    def terms(self, plan: PlanSpec, context: EngineContext) -> EngineTerms:
        if plan.partial_params:
            return blend_partial(plan, self.terms(plan_spec("zero3"), context),
                                 self.terms(plan_spec("zero3-offload-params"), context))
        policy = context.policy
        if plan.offload:
            optimizer = FP32_BYTES + context.fp32_state_bytes
        else:
            optimizer = policy.master_bytes + context.state_bytes
        # Stage 3 keeps no compute-dtype shard beside a separate master (mixed precision,
        # offload): each gather casts the master (flat/bucket.py, [Note: no compute copy beside a master]).
        separate_master = policy.master_bytes > 0 or plan.offload
        param_bytes = 0 if plan.shards_params and separate_master else policy.param_bytes
        if plan.offload_params:  # the host master is then the only parameter shard: a parameter
            param_bytes, optimizer = FP32_BYTES, context.fp32_state_bytes  # (stages/reports.py)
        per_param = BytesPerParam(param_bytes, policy.grad_bytes, optimizer)
        states = model_state_bytes(plan, context.psi, context.world_size, per_param,
                                   shard_numel_per_rank=context.shard_numel_per_rank,
                                   extra_optimizer_state_bytes=context.factored_bytes(sharded=False))
        return EngineTerms(
            states.params, states.grads, states.optimizer_states,
            forward=_forward_buffers(plan, context),
            step=_step_buffers(plan, context),
            **offloaded_terms(plan, states))


def offloaded_terms(plan: PlanSpec, states: ModelStateBytes) -> dict[str, dict[str, int]]:
    """Where a plan's offloaded bytes live: host memory, or the disk tier's files for the
    master, the optimizer's state and the parameter shards (the gradients wait on the host)."""
    host = nonzero(params=states.host_params, grads=states.host_grads, optimizer_states=states.host_optimizer_states)
    if not plan.disk:
        return {"host": host}
    on_disk = {kind: host.pop(kind) for kind in ("params", "optimizer_states") if kind in host}
    return {"host": host, "disk": on_disk}


def _forward_buffers(plan: PlanSpec, context: EngineContext) -> dict[str, int]:
    if not plan.shards_params:
        return nonzero(gradient_bucket=context.bucket_bytes)
    if not context.reshard_after_forward:  # every unit stays gathered from its forward to its backward
        return nonzero(gathered_units=context.psi * context.policy.param_bytes, gradient_bucket=context.bucket_bytes)
    unit = context.largest_unit
    # Prefetch cannot hold more units than the model has (a one-unit model gathers once).
    live_units = min(1 + context.prefetch, math.ceil(context.psi / unit))
    return nonzero(gathered_units=unit * context.policy.param_bytes * live_units,
                   gradient_bucket=context.bucket_bytes)


def _step_buffers(plan: PlanSpec, context: EngineContext, in_backward: bool = False) -> dict[str, int]:
    """``in_backward``: the step inside backward, over runs of at most ``STEP_GROUP_BYTES`` of a
    bucket's pieces (a larger piece alone, at most the largest tensor; optim/step_groups.py)."""
    if plan.offload:
        return {}  # the step, its fp32 gradients and temporaries live on the host
    policy = context.policy
    state_dtype = FP32_BYTES if policy.mixed else policy.state_bytes
    if plan.stage == 0 and not policy.mixed:  # the user's optimizer over the original tensors
        return nonzero(optimizer_step_temporaries=step_temporary_bytes(
            context.optimizer, context.implementation, context.psi, context.largest_tensor, state_dtype))
    # Each flat bucket's slice is one stepped tensor: a bucket holds up to bucket_bytes of
    # parameters, or one larger parameter alone; stage 3 steps a unit's shard.
    bucket = min(context.psi, max(context.bucket_bytes // policy.param_bytes, context.largest_tensor))
    if plan.stage == 0:
        per_call = bucket
    elif plan.stage == 3:
        per_call = math.ceil(context.largest_unit / context.world_size)
    else:
        per_call = math.ceil(bucket / context.world_size)
    if in_backward:
        per_call = min(per_call, max(STEP_GROUP_BYTES // state_dtype, context.largest_tensor))
    stepped = context.psi if plan.stage == 0 else context.shard
    if context.optimizer in STEPPED_BY_BUCKET:  # one bucket at a time (see the module docstring)
        stepped = per_call = min(per_call, stepped)
    # A for-loop optimizer's unit is one stepped tensor: the engine hands it a parameter's
    # fragment of the bucket at a time, so no larger than the largest parameter.
    unit = min(per_call, stepped)
    if context.optimizer in ELEMENTWISE:
        unit = min(unit, context.largest_tensor)
    return nonzero(
        fp32_master_grads=FP32_BYTES * stepped if policy.mixed else 0,
        optimizer_step_temporaries=step_temporary_bytes(context.optimizer, context.implementation,
                                                        stepped, unit, state_dtype))


def in_backward_terms(plan: PlanSpec, context: EngineContext, terms: EngineTerms) -> EngineTerms:
    """``shard(step_in_backward=True)``: each bucket's reduced slice is stepped where it lands
    and freed, so at the step (now inside backward) one bucket's slice is held at stages 2-3
    (stage 3: one unit's); stage 1 still fills its full gradient buckets during backward. The
    step runs over capped runs of a bucket's pieces; no gradient survives backward."""
    capped = _step_buffers(plan, context, in_backward=True)
    if sum(capped.values()) < sum(terms.step.values()):  # (an adapter's step may be smaller still)
        terms = replace(terms, step=capped)
    if plan.stage >= 2:
        bucket = min(context.psi, max(context.bucket_bytes // context.policy.param_bytes, context.largest_tensor))
        elements = context.largest_unit if plan.stage == 3 else bucket
        grads = min(terms.grads, context.policy.grad_bytes * math.ceil(elements / context.world_size))
        terms = replace(terms, grads=grads)
    return replace(terms, grads_transient=True)


def blend_partial(plan: PlanSpec, resident: EngineTerms, on_host: EngineTerms) -> EngineTerms:
    """A fractional plan from counts alone: the share ``f`` of the model states as
    ``zero3-offload-params`` holds them, the rest as ``zero3`` (a module input is planned unit
    by unit instead, shardengine_exact.py). With a budget, ``f`` is what does not fit it of
    zero3's device states. Buffers are zero3's: the gathers and the device step are the same."""
    share = plan.params_fraction
    if share is None:
        share = 1 - min(1.0, plan.device_budget / resident.states) if resident.states else 0.0

    def part(size: int, weight: float) -> int:
        return math.ceil(size * weight)

    return replace(resident, params=part(resident.params, 1 - share), grads=part(resident.grads, 1 - share),
                   optimizer_states=part(resident.optimizer_states, 1 - share),
                   host={kind: part(size, share) for kind, size in on_host.host.items()})


def partial_plans(fraction: float | None = None, budget: int | str | None = None) -> tuple[PlanSpec, ...]:
    """The fractional offload plan asked for (none for neither; a fraction of 1 is the
    ``zero3-offload-params`` plan already there). ``budget``: bytes, or a size like "8GiB".

    >>> [plan.name for plan in partial_plans(0.25)], partial_plans(budget="1KiB")[0].device_budget
    (['zero3-offload-params-0.25'], 1024)
    """
    if fraction is not None and budget is not None:
        raise EstimatorInputError("give a fraction of the parameters on the host or a device budget, not both")
    if budget is not None:
        return (partial_plan(budget=parse_bytes(budget, allow_zero=True) if isinstance(budget, str) else budget),)
    if fraction is None or fraction == 1:
        return ()
    return (partial_plan(float(fraction)),)
