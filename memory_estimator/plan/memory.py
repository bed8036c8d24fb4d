"""Per-plan byte accounting at the peak moment, the fit verdict, and what to change when nothing fits.

Everything here is a pure function of the model facts, the training setup, the device,
an engine model and an activation model; the public ``estimate`` wires them together.

[Note: terms are a snapshot of the peak moment]
Each plan is evaluated at the moments that can be its peak (``engines/base.py``): the
end of forward, the recompute of a checkpointed layer in backward, the optimizer step.
The terms reported are those alive at the largest: at the step, activations are 0
(freed) and the working set holds the step's buffers; at the end of forward, gradients
that backward has not created yet are 0. ``peak_moment`` names the moment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from ..terms.activations import ActivationProfile
from .capacity import with_capacity
from .estimates import RESERVED_ONLY, VERDICTS, PlanEstimate  # noqa: F401 - RESERVED_ONLY: read from here too
from .inputs import MemoryInputs
from .setup import TrainingSetup
from ..hardware.devices import Device
from ..engines.shardengine_exact import ExactShardEngineModel
from ..engines import EngineMemoryModel, EngineContext, EngineTerms, ShardEngine
from ..engines.base import keeps_linear_inputs
from ..engines.shardengine import in_backward_terms as shardengine_in_backward
from ..terms.finetune import (adapt_terms, autocast_cast_numel, in_backward_terms, load_host_peak_bytes,
                              outside_allocator_bytes, paged_share)
from ..terms.model_states import PlanSpec
from ..terms.overheads import Overheads, ResolvedOverheads, resolve_overheads
from .confidence import PlanConfidence, judge
from .spread import Cached, PlanParts, plan_confidence
from ..terms.precision import amp_weight_cache_bytes
from ..model.stats import ModelStats

__all__ = ["Overheads", "TrainingSetup", "MemoryInputs", "PlanEstimate", "plan_estimate", "all_plans", "least_sharded_fit",
           "largest_fitting", "smallest_fitting", "plan_fits_with", "suggestions", "usable_bytes", "VERDICTS"]

# Searches for a micro-batch or a world size stop here: beyond it the answer is "no".
SEARCH_LIMIT = 1 << 20


def usable_bytes(device: Device, safety_margin: float) -> int:
    """Device memory minus the safety margin: the budget a plan's total must fit in."""
    return int(device.memory_bytes * (1.0 - safety_margin))


@dataclass(frozen=True)
class _Moment:
    name: str
    grads: int
    activations: int
    logits: int
    buffers: dict[str, int]


def _moments(terms: EngineTerms, profile: ActivationProfile, logits: int, amp_cache: int,
             grads_freed: bool = True) -> list[_Moment]:
    """The candidate peaks: end of forward, the head's fetch just before it (when the engine
    names buffers of that moment), recompute in backward, the optimizer step."""
    grads_early = 0 if terms.grads_transient and grads_freed else terms.grads
    with_activations = {**terms.persistent, **terms.forward}
    if amp_cache:
        with_activations["autocast_weight_cache"] = amp_cache
    moments = [_Moment("forward", grads_early, profile.stored, logits, with_activations)]
    if terms.before_logits:
        moments.append(_Moment("head fetch", grads_early, profile.stored, 0,
                               {**with_activations, **terms.before_logits}))
    if profile.recompute:
        moments.append(_Moment("recompute", grads_early, profile.stored + profile.recompute, 0, with_activations))
    moments.append(_Moment("step", terms.grads, 0, 0, {**terms.persistent, **terms.step}))
    return moments


def _moment_total(terms: EngineTerms, moment: _Moment, overheads: ResolvedOverheads,
                  outside: int = 0) -> tuple[int, int]:
    """(total, fragmentation) of one moment; ``outside`` bytes (paged optimizer states) are not
    the caching allocator's, so they fragment none of its segments."""
    dynamic = (terms.params + terms.optimizer_states + moment.grads + moment.activations + moment.logits
               + sum(moment.buffers.values()))
    fragmentation = math.ceil(overheads.fragmentation_fraction * (dynamic - outside))
    return dynamic + overheads.fixed + fragmentation, fragmentation


def _engine_terms(plan: PlanSpec, stats: ModelStats, setup: TrainingSetup, engine: EngineMemoryModel,
                  exact: ExactShardEngineModel | None) -> EngineTerms:
    if exact is not None and exact.applies(setup.world_size) and isinstance(engine, ShardEngine):
        return exact.terms(plan, setup.precision if setup.amp is None else "fp32", setup.optimizer,
                           setup.optimizer_impl, setup.prefetch_depth, setup.optimizer_in_backward)
    context = lambda model: EngineContext(model, setup.world_size, setup.policy, setup.optimizer,  # noqa: E731
                                          setup.optimizer_impl, setup.prefetch_depth, setup.bucket_bytes,
                                          setup.shard_numel_per_rank, setup.reshard_after_forward)
    terms = (adapt_terms(plan, stats, setup, engine, context) if setup.adapters is not None
             else engine.terms(plan, context(stats)))
    if setup.optimizer_in_backward and isinstance(engine, ShardEngine):
        terms = shardengine_in_backward(plan, context(stats), terms)
    elif setup.optimizer_in_backward:
        terms = in_backward_terms(plan, stats, setup, terms)
    return terms


def plan_estimate(plan: PlanSpec, inputs: MemoryInputs) -> PlanEstimate:
    """Every per-rank term of one plan at its peak moment and the verdict on the device.

    With ``inputs.exact`` (a module planned by shardengine's own planner, at this world
    size) the model states are the engine's exact bytes and the buffers follow its planner.
    """
    stats, setup, device = inputs.stats, inputs.setup, inputs.device
    if keeps_linear_inputs(inputs.engine, plan):
        setup = replace(setup, linear_inputs_kept=True)
    terms = _engine_terms(plan, stats, setup, inputs.engine, inputs.exact)
    resolved = resolve_overheads(inputs.overheads, device, setup.world_size, setup.module_loading,
                                 getattr(inputs.engine, "communicators", 1))
    profile = inputs.model.activations(setup.micro_batch, setup)
    logit_bytes = inputs.model.logits(setup.micro_batch, setup) if resolved.logits else 0
    amp_cache = amp_weight_cache_bytes(setup.policy, autocast_cast_numel(stats, setup))
    # Gradients accumulated over micro-steps live through the next micro-steps' forwards.
    freed = setup.zero_grad_to_none and setup.grad_accum == 1
    outside = outside_allocator_bytes(setup.optimizer, terms.optimizer_states, paged_share(stats, setup))
    scored = [(_moment_total(terms, moment, resolved, outside), moment)
              for moment in _moments(terms, profile, logit_bytes, amp_cache, freed)]
    (total, fragmentation), peak = max(scored, key=lambda item: item[0][0])
    cached = _cached_segments(terms, peak, inputs, profile.peak + logit_bytes, total)
    overhead = resolved.fixed + peak.logits + fragmentation + sum(cached.point.values())
    buffers = {**peak.buffers, **{name: size for name, size in (
        ("cuda_context", resolved.cuda_context), ("nccl_buffers", resolved.nccl),
        ("logits_and_loss", peak.logits), ("allocator_fragmentation", fragmentation), *cached.point.items()) if size}}
    total += sum(cached.point.values())
    usable = usable_bytes(device, setup.safety_margin)
    # paged optimizer states move to the host under pressure: the verdict is judged without them
    parts = PlanParts(terms, peak.name, peak.activations, peak.logits, buffers, resolved, outside, total, cached)
    confidence = _with_logits_cast(plan, inputs, parts, plan_confidence(parts, inputs))
    verdict = judge(confidence.low - outside, confidence.high - outside, usable, device.memory_bytes)
    return with_capacity(PlanEstimate(
        plan.name, plan.stage, plan.offload, terms.params, peak.grads, terms.optimizer_states,
        peak.activations, sum(peak.buffers.values()), overhead, fits=verdict == "fits",
        headroom=usable - confidence.high + outside, host_optimizer_states=terms.host.get("optimizer_states", 0),
        host_params=terms.host.get("params", 0), host_grads=terms.host.get("grads", 0),
        host_bytes=terms.host_total + profile.host, disk_bytes=sum(terms.disk.values()),
        disk_params=terms.disk.get("params", 0), peak_moment=peak.name, verdict=verdict, buffers=buffers,
        moments={moment.name: item[0] for item, moment in scored},
        outside_allocator=outside, load_host_peak=load_host_peak_bytes(plan, stats, setup), confidence=confidence,
        device_verdict=verdict, host_activations=profile.host,
        kept_activations=profile.kept), inputs.capacity, setup.world_size)


def _with_logits_cast(plan: PlanSpec, inputs: MemoryInputs, parts: PlanParts, confidence: PlanConfidence
                      ) -> PlanConfidence:
    """With an unstated logits cast (Unsloth's, ``[Note: logits cast to the checkpoint's dtype]``)
    the answer's point is without it and its high end is the same plan priced with it: the whole
    rise (the cast copy, the fragmentation on it, a peak that moves to another moment, the longer
    batches' segments replayed with it) is carried by the logits term's high, so that every other
    term, the allocator's replay included, stays at the point's and nothing is counted twice."""
    if not inputs.setup.logits_cast_unstated(inputs.model.architecture):
        return confidence
    cast = replace(inputs, setup=replace(inputs.setup, logits_cast=True), shape_cache=inputs.cast_shape_cache)
    priced = plan_estimate(plan, cast).confidence
    if priced.high <= confidence.high:
        return confidence
    ranged = plan_confidence(replace(parts, logits_cast_rise=priced.high - confidence.high), inputs)
    # what the high end turns on with the cast (its cache cut at the device) is the answer's too
    return replace(ranged, turns_on=ranged.turns_on + tuple(t for t in priced.turns_on if t not in ranged.turns_on),
                   unbounded=ranged.unbounded + tuple(u for u in priced.unbounded if u not in ranged.unbounded))


def _cached_segments(terms: EngineTerms, peak: _Moment, inputs: MemoryInputs, shape_bytes: int, total: int) -> Cached:
    """Segments the caching allocator holds beside the peak's tensors (reserved, not allocated):
    the engine's own (``EngineTerms.cached``: buffers of another moment its tensors cannot be
    carved from) and, when batch lengths vary, those the longer batches left (``allocator/``),
    no more than the device can map (the allocator frees its cache and retries beyond)."""
    if inputs.device.kind == "cpu":
        return Cached({}, {}, {})
    engine: dict[str, int] = {}
    # expandable segments map one growing segment: freed step buffers are carved again by anything
    if peak.name != "step" and (terms.cached or terms.cached_carvable) and not inputs.setup.expandable_segments:
        beside = sum(terms.cached.values()) + max(0, terms.cached_carvable - shape_bytes)
        engine = {"cached_step_segments": beside} if beside else {}
    cache = inputs.shape_cache
    lengths = {} if cache is None else {
        which: cache.excess(shape_bytes, which) for which in ("median", "low", "high")}
    room = max(0, inputs.device.memory_bytes - total)

    def held(which: str) -> dict[str, int]:
        """What is cached at one end of the range, no more than the device can map beside the peak."""
        wanted = {**engine, **({"cached_segments_other_lengths": lengths[which]} if lengths else {})}
        left, out = room, {}
        for name, size in wanted.items():
            out[name] = min(size, left)
            left -= out[name]
        return out

    wanted_high = sum(engine.values()) + lengths.get("high", 0)
    return Cached(held("median"), held("low"), held("high"), unbounded_above=wanted_high > room)


def all_plans(inputs: MemoryInputs) -> tuple[PlanEstimate, ...]:
    """Every plan the engine runs, in its order (least communication first); with the step in
    backward, shardengine's plans that shard() accepts with it."""
    plans = inputs.engine.plans
    if inputs.setup.optimizer_in_backward and isinstance(inputs.engine, ShardEngine):
        plans = tuple(p for p in plans if ShardEngine.steps_in_backward(p))
    return tuple(plan_estimate(plan, inputs) for plan in plans)


def least_sharded_fit(plans: tuple[PlanEstimate, ...]) -> PlanEstimate | None:
    """Plans are ordered by communication cost, so the first plan that fits is the cheapest."""
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


def plan_fits_with(plan: PlanSpec, inputs: MemoryInputs) -> bool:
    return plan_estimate(plan, inputs).fits


def _min_world_size(plan: PlanSpec, inputs: MemoryInputs) -> int | None:
    # A shard's exact size is known to the engine only for the current N; let it vary here.
    setup = inputs.setup
    n_fits = lambda n: plan_fits_with(plan, replace(  # noqa: E731
        inputs, setup=replace(setup, world_size=n, shard_numel_per_rank=None), exact=None))
    return smallest_fitting(n_fits, setup.world_size)


def _advice_for(label: str, inputs: MemoryInputs) -> list[str]:
    """What fits under one changed setup: a plan at the current N, else the N the sharded plans need."""
    fitting = least_sharded_fit(all_plans(inputs))
    if fitting is not None:
        return [f"{label}: {fitting.name} fits at world size {inputs.setup.world_size}"]
    advice = []
    for plan in inputs.engine.plans:
        if plan.stage < 3:
            continue
        minimum = _min_world_size(plan, inputs)
        if minimum is not None:
            advice.append(f"{label}: {plan.name} fits with world size >= {minimum}")
    return advice


def _disk_tier_advice(inputs: MemoryInputs) -> list[str]:
    """Where a plan fits the device but not the host's RAM, the disk tier's plans (files on the
    node's drive instead of host memory), when the engine has them and they were not asked for."""
    from ..engines import DeepSpeedZero

    engine = inputs.engine
    if any(plan.disk for plan in engine.plans) or not any(
            p.device_verdict == "fits" and p.host_verdict == "does not fit" for p in all_plans(inputs)):
        return []
    if isinstance(engine, ShardEngine):
        tier = ShardEngine(disk=True, partial=tuple(plan for plan in engine.plans if plan.partial_params))
    elif isinstance(engine, DeepSpeedZero):
        tier = DeepSpeedZero(engine.knobs, disk=True)
    else:
        return []
    fitting = [plan for plan in all_plans(replace(inputs, engine=tier)) if plan.fits and plan.disk_bytes]
    from .capacity import conditions

    return [f"the disk tier (--offload disk): {plan.name} fits"
            + (f" if {' and '.join(conditions(plan))}" if plan.verdict == "fits if"
               else f" ({plan.disk_bytes_per_node / 2**30:.2f} GiB of files per node)") for plan in fitting[:1]]


def suggestions(inputs: MemoryInputs) -> tuple[str, ...]:
    """What would make training fit when no plan does: more GPUs, a smaller micro-batch,
    full activation checkpointing, offload — alone first, then combined."""
    setup, engine = inputs.setup, inputs.engine
    full = replace(setup, checkpointing="full")
    candidates = [("as requested", setup)]
    if setup.micro_batch > 1:
        b_fits = lambda b: least_sharded_fit(  # noqa: E731
            all_plans(inputs.with_setup(replace(setup, micro_batch=b)))) is not None
        smaller = largest_fitting(b_fits, 1, limit=setup.micro_batch - 1)
        candidates.append((f"micro-batch {smaller or 1}", replace(setup, micro_batch=smaller or 1)))
    if setup.checkpointing != "full":
        candidates.append(("full checkpointing", full))
        if setup.micro_batch > 1:
            candidates.append(("full checkpointing and micro-batch 1", replace(full, micro_batch=1)))
    advice = _disk_tier_advice(inputs)
    for label, candidate in candidates:
        advice += _advice_for(label, inputs.with_setup(candidate))
    if not advice and max(plan.stage for plan in engine.plans) < 3:
        advice.append(f"nothing tried fits: {engine.name} cannot shard parameters; a sharding engine can "
                      "(--engine fsdp2, deepspeed or shardengine)")
    if not advice:
        advice.append("nothing tried fits (more GPUs, micro-batch 1, full checkpointing, offload): the part "
                      "that does not shrink with N (activations, gathered units, overheads) exceeds a rank's "
                      "memory; shorten the sequence, give --largest-layer, or use a larger device")
    return tuple(advice)
