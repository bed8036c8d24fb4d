"""The plans ``--objective fastest`` chooses among: the engine's own, and shardengine's fractions.

[Note: the planner and the recommended line see the same plans]
shardengine runs any fraction of the parameters on the host, so the planner also tries
:data:`FRACTIONS` (the least one that fits moves only what the memory demands, usually the
fastest). The objective's recommended plan is priced over the same candidates
(:func:`with_candidate_plans`), so the "recommended" line never names a slower plan than the
planner found at the same setup. Every other engine plans only what it runs: its own plans,
and hybrid sharding at the stages it shards within groups (``hybrid_stages``).
"""
from __future__ import annotations

from dataclasses import replace

from ..engines import ShardEngine
from ..terms.model_states import partial_plan
from .memory import all_plans

# shardengine's fractional offload plans the planner also tries (zero3-offload-params is 1.0)
FRACTIONS = (0.25, 0.5, 0.75)


def with_fractions(inputs):
    """``inputs`` whose shardengine model also plans :data:`FRACTIONS` (other engines: as given)."""
    engine = inputs.engine
    if not isinstance(engine, ShardEngine):
        return inputs
    have = {plan.name for plan in engine.plans}
    extra = tuple(plan for plan in (partial_plan(f) for f in FRACTIONS) if plan.name not in have)
    if not extra:
        return inputs
    partial = tuple(plan for plan in engine.plans if plan.partial_params)
    disk = any(plan.disk for plan in engine.plans)  # the disk tier's plans stay when asked for
    return replace(inputs, engine=ShardEngine(disk=disk, partial=partial + extra))


def with_candidate_plans(result):
    """The estimate ``result`` with every plan the planner searches priced (the same when none is added)."""
    inputs = result.memory_inputs
    widened = with_fractions(inputs)
    if widened is inputs:
        return result
    return replace(result, plans=all_plans(widened), engine_model=widened.engine)
