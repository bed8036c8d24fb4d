"""``stage="auto"``'s printed plan: one line per lever, each with why.

A lever's "why" is the candidate that differs from the chosen run in that lever alone, set
to what costs least (the less sharded stage, every unit resident, the optimizer on the
device, resharding after forward, no checkpointing, no activation offload, the whole batch
in one micro-step): it did not fit (the device or the node, by how much), or it fitted and
was slower (its predicted step), or it was ranked after the chosen run (no time model).
"""
from __future__ import annotations

from typing import Optional

from ..terms.model_states import PLAN_NAMES, plan_spec
from ..byte_units import format_bytes
from .capacity import conditions, shortfalls
from .memory import usable_bytes
from .search import PlannedRun, Search


def explain(found: Search, best: PlannedRun, result, activations: str, timed_how: str) -> list[str]:
    """The lines ``stage="auto"`` prints for ``best`` (see the module docstring)."""
    usable = usable_bytes(result.device, result.setup.safety_margin)

    def why(alternative: Optional[PlannedRun], what: str) -> str:
        if alternative is None:
            return f"{what}: not a plan the engine runs here"
        if not alternative.fits:
            estimate = alternative.estimate
            if estimate is not None and estimate.device_verdict == "fits":
                return f"{what} does not fit the node ({'; '.join(shortfalls(estimate))})"
            return f"{what} needs {format_bytes(alternative.memory_bytes)} of the {format_bytes(usable)} usable per rank"
        if best.timed and alternative.timed:
            return f"{what} is slower ({alternative.step_s:.3g} s/step against {best.step_s:.3g})"
        return f"{what} fits but is ranked after it (its levers cost more)"

    spec = plan_spec(best.plan)
    lines = [_stage_line(found, best, spec, why), _parameters_line(found, best, spec, why),
             _optimizer_line(found, best, spec, why)]
    if spec.stage == 3:
        other = found.like(best, reshard_after_forward=not best.reshard_after_forward)
        lines.append(f"reshard_after_forward: {best.reshard_after_forward} — "
                     + why(other, f"{not best.reshard_after_forward}"))
    lines.append(f"activation checkpointing: {best.checkpointing} — " + (
        "every activation fits without recomputation" if best.checkpointing == "none"
        else why(found.like(best, checkpointing="none"), "none")))
    lines.append(f"activation offload: {'on' if best.activation_offload else 'off'} — " + (
        why(found.like(best, activation_offload=False), "off") if best.activation_offload
        else "the activations stay on the device"))
    lines.append(_batch_line(found, best, why))
    estimate = best.estimate
    if estimate is not None:
        host = f", {format_bytes(estimate.host_activations)} offloaded to the host" if estimate.host_activations else ""
        kept = (f" (of which {format_bytes(estimate.kept_activations)} kept for backward, what memory_report()'s "
                "peak_activations measures)") if estimate.kept_activations else ""
        lines.append(f"activations: {activations}: {format_bytes(estimate.activations)} per rank at the peak{kept}{host}")
    lines.append(_estimated_line(found, best, result, timed_how))
    return lines


def _stage_line(found: Search, best: PlannedRun, spec, why) -> str:
    text = f"stage: {spec.stage} ({best.plan})"
    if spec.stage == 0:
        return text + " — the least sharded plan"
    less = PLAN_NAMES[spec.stage - 1]
    # (only stage 3 runs without resharding after forward: the stage below reshards)
    return text + " — " + why(found.like(best, plan=less, reshard_after_forward=True), f"stage {spec.stage - 1} ({less})")


def _parameters_line(found: Search, best: PlannedRun, spec, why) -> str:
    if spec.offload_params:
        share = "all of them"
    elif spec.params_fraction is not None:
        share = f"{spec.params_fraction:.0%} of the elements, whole units"
    elif spec.device_budget is not None:
        share = f"the units beyond {format_bytes(spec.device_budget)} of model states kept on the device"
    else:
        return "parameters on the host: none"
    return (f"parameters on the host: {share} — "
            + why(found.like(best, plan="zero3"), "every unit resident (zero3)"))


def _optimizer_line(found: Search, best: PlannedRun, spec, why) -> str:
    if spec.offload_params or spec.partial_params:
        return "optimizer: steps on the host for the units whose parameters are there, on the device for the others"
    if not spec.offload:
        return "optimizer: on the device"
    return "optimizer: on the host (fp32 master and state) — " + why(found.like(best, plan="zero3"), "on the device")


def _batch_line(found: Search, best: PlannedRun, why) -> str:
    batch = best.micro_batch * best.grad_accum
    text = f"micro-batch: {best.micro_batch} x accumulation {best.grad_accum} (the {batch} sequences per rank per step given)"
    if best.grad_accum == 1:
        return text
    return (text + " — " + why(found.like(best, micro_batch=batch), f"micro-batch {batch}")
            + f"; shard() cannot change the loop: run {best.grad_accum} micro-steps of {best.micro_batch} per "
              "optimizer step (model.no_sync() on all but the last; model.auto_plan says so)")


def _estimated_line(found: Search, best: PlannedRun, result, timed_how: str) -> str:
    device = result.device
    text = f"estimated: {format_bytes(best.memory_bytes)} of {format_bytes(device.memory_bytes)} per rank"
    if best.host_bytes_per_node:
        capacity = result.capacity.host_memory_bytes
        text += (f", host RAM {format_bytes(best.host_bytes_per_node)} per node"
                 + (f" of {format_bytes(capacity)}" if capacity is not None else ""))
    if best.verdict == "fits if" and best.estimate is not None:
        text += f" (fits if {' and '.join(conditions(best.estimate))})"
    text += f"; {timed_how}"
    if best.timed:
        text += f": {best.step_s:.3g} s/step"
        after = [run for run in found.ranked if run is not best][:2]
        if after:
            text += "; next: " + ", ".join(f"{_label(run)} {run.step_s:.3g} s" for run in after)
    return text


def _label(run: PlannedRun) -> str:
    levers = [run.plan, f"checkpointing {run.checkpointing}"]
    if run.activation_offload:
        levers.append("activation offload")
    if not run.reshard_after_forward and run.stage == 3:
        levers.append("no reshard")
    if run.grad_accum > 1:
        levers.append(f"micro-batch {run.micro_batch}x{run.grad_accum}")
    return "/".join(levers)
