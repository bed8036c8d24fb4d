"""``stage="auto"``'s plan: the one planner's fastest run, for the engine to apply and print.

The engine (``shardengine/auto.py``) asks on rank 0 with a request for its module on this
machine (the device budget, the node's RAM, its ranks); this module builds the inputs the
module implies (``model/implied_inputs.py``: activations are always counted), prices the
step on this machine when rates are known (a calibration, or the catalog's GPU), searches
every lever the engine offers (``search.py``) and answers with a plain dict every rank
applies alike: the plan's options, its micro-batch and accumulation (advice the training
loop applies: ``shard()`` cannot), and one line per lever saying why (``auto_explain.py``).
"""
from __future__ import annotations

from typing import Any, Optional

from ..api import estimate
from ..byte_units import format_bytes
from ..errors import EstimatorInputError
from ..hardware.calibration import load_calibration
from ..hardware.devices import THIS_MACHINE, catalog_lookup
from ..hardware.rates import device_rates
from ..model.implied_inputs import implied_inputs
from ..request import EstimateRequest
from ..terms.model_states import plan_spec
from .auto_explain import explain
from .search import Levers, PlannedRun, search
from .timed import TimingRequest

__all__ = ["auto_plan", "auto_device", "shard_options"]


def auto_device(gpu_name: Optional[str]) -> Optional[str]:
    """The device an auto estimate names: ``"cpu"`` without a GPU; this machine when it is
    calibrated (its measured rates), else the catalog's part for the GPU's name, else None."""
    if gpu_name is None:
        return "cpu"
    try:
        load_calibration()
        return THIS_MACHINE
    except EstimatorInputError:
        pass
    known = catalog_lookup(gpu_name)
    return known.name if known is not None else None


def _timing(result, local_world_size: int) -> tuple[Optional[TimingRequest], str]:
    """The cluster the step is priced on (this machine's nodes), or None and why not."""
    world = result.world_size
    per_node = local_world_size if world % local_world_size == 0 else world
    calibrated = result.device.kind == "cpu" or result.device.name.startswith(THIS_MACHINE)
    link = THIS_MACHINE if calibrated else None
    try:
        device_rates(THIS_MACHINE if calibrated else result.device.name,
                     load_calibration() if calibrated else None)
    except EstimatorInputError as error:
        return None, (f"not timed ({error}); candidates ranked by their levers' cost: no recomputation, no "
                      "activation offload, the largest micro-batch, the least sharded plan first")
    request = TimingRequest(nodes=world // per_node, gpus_per_node=per_node, intra_node=link, interconnect=link,
                            objective="fastest", shard_group_size=world)
    return request, ("timed with this machine's calibration" if calibrated
                     else f"timed with {result.device.name}'s published rates")


def auto_plan(request: EstimateRequest, *, local_world_size: int = 1, activation_levers: bool = True,
              fixed_activations: bool = False) -> dict[str, Any]:
    """The fastest run that fits ``request``'s device, host and disk, as a plain dict.

    ``activation_levers``: the engine applies checkpointing and activation offload, so they are
    searched (unless ``fixed_activations``: the user chose them, as the request says).
    The request's module gets the example inputs it implies (or an error saying to pass them).
    """
    inputs, traced_from = implied_inputs(request.model.module, request.model.example_inputs)
    result = estimate(request.replaced(example_inputs=inputs))
    timing, timed_how = _timing(result, local_world_size)
    setup = result.setup
    levers = Levers(device_budget=True,
                    reshard_after_forward=(True, False) if setup.reshard_after_forward else (False,))
    if not activation_levers or fixed_activations:
        levers = levers.fixed(setup)
    found = search(result, timing, levers)
    best = found.best
    answer: dict[str, Any] = {
        "totals": {plan.name: plan.total for plan in result.plans}, "suggestions": list(result.suggestions),
        "activations": f"traced on fake tensors from {traced_from}", "timed": timed_how, "recommended": None,
        # as the engine prints them: a toy budget in KiB, a GPU's in GiB
        "sizes": {"budget": format_bytes(result.device.memory_bytes),
                  **{plan.name: format_bytes(plan.total) for plan in result.plans}}}
    if best is None:
        return answer
    answer.update(shard_options(best), recommended=best.plan, total_bytes=best.memory_bytes,
                  lines=explain(found, best, result, answer["activations"], timed_how),
                  ranked=[{**run.to_json_dict(), **shard_options(run)} for run in found.ranked[:3]])
    return answer


def shard_options(run: PlannedRun) -> dict[str, Any]:
    """What ``shard()`` takes for ``run``: stage, tiers, resharding, activation levers, and the
    loop's micro-batch and accumulation."""
    spec = plan_spec(run.plan)
    params: Any = True if spec.offload_params else (spec.params_fraction or False)
    return {"stage": spec.stage, "offload_optimizer": spec.offload and not spec.offload_params,
            "offload_params": params, "device_budget": spec.device_budget,
            "reshard_after_forward": run.reshard_after_forward, "checkpointing": run.checkpointing,
            "activation_offload": run.activation_offload, "micro_batch": run.micro_batch,
            "grad_accum": run.grad_accum, "step_s": run.step_s if run.timed else None,
            "host_bytes_per_node": run.host_bytes_per_node, "verdict": run.verdict,
            "host_bytes": run.estimate.host_bytes if run.estimate is not None else 0}

