"""The largest device budget of shardengine's stage 3 that fits: what ``stage="auto"`` keeps resident.

[Note: stage="auto" offloads only the parameters it must]
When no plan with the parameters resident fits, the last resort is zero3-offload-params: every
unit's shard, gradient and step on the host. What the device still has room for is better spent
keeping units resident: the largest ``offload_device_budget`` (shardengine/flat/residency.py)
whose plan fits, found by bisection (fitting is monotone in the budget). Each resident unit is
one host copy fewer per gather; a budget of 0 is the last resort itself.
"""
from __future__ import annotations

from typing import Optional

from ..terms.model_states import partial_plan, plan_spec
from .memory import PlanEstimate, largest_fitting, plan_estimate


def largest_device_budget(result, inputs=None) -> Optional[tuple[int, PlanEstimate]]:
    """(budget, its plan's estimate) for the largest budget above 0 that fits the estimate
    ``result``'s device (or ``inputs``, a changed setup of it) and its node, or ``None`` when none
    does. Searched up to what stage 3 holds resident in all (a budget above that keeps every unit
    on the device). A smaller budget only moves more to the host, so when the largest budget the
    device holds does not fit the host's RAM, none does."""
    inputs = inputs if inputs is not None else result.memory_inputs

    def estimate(budget: int) -> PlanEstimate:
        return plan_estimate(partial_plan(budget=budget), inputs)

    resident = plan_estimate(plan_spec("zero3"), inputs)  # every unit resident
    budget = largest_fitting(lambda b: estimate(b).device_verdict == "fits", 1, max(1, resident.total))
    if budget is None or not estimate(budget).fits:
        return None
    return budget, estimate(budget)
