"""The estimator's per-rank peak against the measured one, per stage, term by term.

Measured as ``python -m memory_estimator.measure.validate`` measures (the same code):
model states from ``memory_report()``, the step's transient peak from
``torch.cuda.max_memory_allocated()`` on a GPU, on a CPU from the allocator's
events (``torch.profiler`` with ``profile_memory``). Predicted by ``estimate()``
for the live module with zero overheads (a CPU has none; on a GPU the context
and fragmentation are what the calibration measures, compared separately).
A row passes when the total is within ``tolerance``; the terms that missed by
more are named.
"""
from __future__ import annotations

from typing import Sequence

import torch

from memory_estimator.measure import validate
from memory_estimator import EngineOptions

from .verdict import Check

TERMS = ("params", "grads", "optimizer_states", "transient")
CASE = "gpt-tiny"


def _missed_terms(predicted: dict, measured: dict, tolerance: float) -> list[str]:
    missed = []
    for term in TERMS:
        want, got = predicted[term], measured[term]
        if abs(want - got) > tolerance * max(got, 1):
            missed.append(f"{term} {want / 2**20:.2f}/{got / 2**20:.2f} MiB")
    return missed


def memory_row(stage: int, world: int, precision: str, predicted: dict, measured: dict, tolerance: float,
         simulated: bool) -> Check:
    error = (predicted["total"] - measured["total"]) / measured["total"]
    missed = _missed_terms(predicted, measured, tolerance)
    where = f"one rank of N={world}" + (" (fake group)" if simulated else "")
    largest = max(TERMS, key=lambda term: abs(predicted[term] - measured[term]))
    detail = (f"predicted {predicted['total'] / 2**20:.2f} MiB, measured {measured['total'] / 2**20:.2f} MiB "
              f"({error:+.1%})" + (f"; terms off by more than {tolerance:.0%} (predicted/measured): "
                                   f"{', '.join(missed)}" if missed else
                                   "; every term exact" if predicted[largest] == measured[largest] else
                                   f"; largest term miss {largest} "
                                   f"{(predicted[largest] - measured[largest]) / 2**20:+.2f} MiB"))
    return Check("memory", f"stage {stage} {precision}, {where}", "pass" if abs(error) <= tolerance else "fail",
                 detail)


def simulated_memory_checks(stages: Sequence[int], world: int, precisions: Sequence[str],
                            device: torch.device, tolerance: float) -> list[Check]:
    """On a fake process group of ``world`` ranks (validate opens it): needs a process without a group."""
    rows = validate.run([CASE], stages, world, precisions, steps=1, device=device)
    return [memory_row(r.stage, r.world_size, r.precision, r.predicted, r.measured, tolerance, True) for r in rows]


def live_memory_checks(stages: Sequence[int], world: int, precisions: Sequence[str], device: torch.device,
                       tolerance: float, reduces_in_place: bool) -> list[Check]:
    """In the launched world (every rank runs it): this rank's peak against the estimate for N."""
    case = validate.MODELS[CASE]()
    checks = []
    for precision in precisions:
        for stage in stages:
            predicted = _predict(case, stage, world, precision, device, reduces_in_place)
            measured = validate.measure(case, stage, world, precision, 1, device)
            checks.append(memory_row(stage, world, precision, predicted, measured, tolerance, False))
    return checks


def _predict(case, stage: int, world: int, precision: str, device: torch.device, reduces_in_place: bool) -> dict:
    from memory_estimator import estimate

    result = estimate(module=case.build(), example_inputs=case.inputs, world_size=world, precision=precision,
                      optimizer="adamw", micro_batch=case.micro_batch, seq_len=case.seq_len,
                      device_memory_bytes=2**50, overheads=validate.NO_OVERHEADS,
                      engine_options=EngineOptions(reduces_in_place=reduces_in_place),
                      optimizer_impl="foreach" if device.type == "cuda" else "plain")
    plan = result.plan(validate.STAGE_PLANS[stage])
    return {"params": plan.params, "grads": plan.grads, "optimizer_states": plan.optimizer_states,
            "transient": plan.activations + plan.working_set + plan.overhead, "total": plan.total}
