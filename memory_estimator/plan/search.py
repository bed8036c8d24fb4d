"""One planner over every lever: the fastest run that fits the device, the host and the disk.

[Note: one planner over every lever]
A run chooses, per rank: the stage (0-3); whether stage 3 reshards after forward; how much
of the parameters lives on the host (none, shardengine's fractions, a device budget's share,
all); where the optimizer steps (device, host, files: the plan); the activation
checkpointing policy (:data:`POLICIES`); activation offload; and the split of its batch
into micro-batch x accumulation (the batch per optimizer step kept). :func:`search` prices
every combination the engine runs: memory on the device, the host and the disk
(``memory.py``, ``capacity.py``) and, given a cluster, the time per step (``timed.py``: the
recomputation each policy runs is priced by ``timing/operations.py``, the activation copies
over the host link by ``timing/step.py``). It keeps the candidates that fit all three
budgets and ranks them by predicted step time. Without a time model (no rates known for
the device) it ranks by the order tried, which puts the cheapest levers first: no
recomputation, then cheaper checkpointing; no activation offload; the largest
micro-batch; resharding after forward; the least sharded plan. ``--objective fastest``
(``fastest.py``) and ``stage="auto"`` (``shardengine/auto.py``) both take its first.

Activation offload and resharding after forward are shardengine's levers (``shard(
activation_offload=True)``, ``reshard_after_forward=False``); for the other engines the
planner varies the checkpointing policy, which a training script applies itself, the
micro-batch and the plans.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from ..engines import ShardEngine
from ..terms.model_states import plan_spec
from .candidates import with_fractions
from .capacity import conditions
from .device_budget import largest_device_budget
from .memory import MemoryInputs, PlanEstimate, all_plans

# cheaper recomputation first (ties go to the first): element-wise kernels, half the layers,
# element-wise and every other matmul, everything
POLICIES = ("none", "selective:mm", "every-k:2", "selective:op", "full")


@dataclass(frozen=True)
class PlannedRun:
    """One candidate run: its plan (with its hybrid group), levers, memory and predicted time.

    ``step_s`` is NaN when no time model priced it; ``fits`` is over the device, the host
    and the disk (``verdict`` "fits if": the node's host RAM or disk it needs is not stated).
    """

    plan: str
    stage: int
    offload: bool
    shard_group_size: int
    checkpointing: str
    micro_batch: int
    grad_accum: int
    step_s: float
    tokens_per_s: float
    memory_bytes: int
    activation_offload: bool = False
    reshard_after_forward: bool = True
    host_bytes_per_node: int = 0
    disk_bytes_per_node: int = 0
    verdict: str = "fits"
    order: int = 0                   # when it was tried (ties and the rate-free ranking)
    estimate: Optional[PlanEstimate] = field(default=None, compare=False, repr=False)
    refined_from: Optional[str] = None  # a device budget's plan: the plan it refines (its levers' peers)

    @property
    def fits(self) -> bool:
        return self.verdict in ("fits", "fits if")

    @property
    def timed(self) -> bool:
        return not math.isnan(self.step_s)

    def to_json_dict(self) -> dict:
        return {"plan": self.plan, "stage": self.stage, "offload": self.offload,
                "shard_group_size": self.shard_group_size, "checkpointing": self.checkpointing,
                "activation_offload": self.activation_offload, "reshard_after_forward": self.reshard_after_forward,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "step_time_s": self.step_s if self.timed else None,
                "tokens_per_s": self.tokens_per_s if self.timed else None, "memory_bytes": int(self.memory_bytes),
                "host_bytes_per_node": int(self.host_bytes_per_node),
                "disk_bytes_per_node": int(self.disk_bytes_per_node), "verdict": self.verdict}

    def text(self) -> str:
        levers = (f"{self.plan} (shard group {self.shard_group_size}), checkpointing {self.checkpointing}"
                  + (", activation offload" if self.activation_offload else "")
                  + (", no resharding after forward" if not self.reshard_after_forward and self.stage == 3 else "")
                  + f", micro-batch {self.micro_batch} x accumulation {self.grad_accum}")
        time = (f"{self.step_s:.4g} s/step, {self.tokens_per_s:,.0f} tokens/s, " if self.timed else "")
        host = f", host {self.host_bytes_per_node / 2**30:.2f} GiB per node" if self.host_bytes_per_node else ""
        condition = (f" (fits if {' and '.join(conditions(self.estimate))})"
                     if self.verdict == "fits if" and self.estimate is not None else "")
        return f"fastest that fits: {levers}: {time}{self.memory_bytes / 2**30:.2f} GiB{host}{condition}"

    def levers(self) -> dict:
        """The levers this run sets (what :meth:`Search.like` compares)."""
        return {"plan": self.refined_from or self.plan, "checkpointing": self.checkpointing,
                "activation_offload": self.activation_offload,
                "reshard_after_forward": self.reshard_after_forward, "micro_batch": self.micro_batch}


@dataclass(frozen=True)
class Levers:
    """What :func:`search` varies: each tuple the values tried (the request's own first)."""

    checkpointing: tuple[str, ...] = POLICIES
    activation_offload: tuple[bool, ...] = (False, True)
    reshard_after_forward: tuple[bool, ...] = (True, False)
    max_splits: int = 6              # micro-batch x accumulation splits, largest micro-batch first
    device_budget: bool = False      # a parameters-on-host pick refined to the largest device budget that fits

    def fixed(self, setup) -> "Levers":
        """These levers with the activation levers held at ``setup``'s (the user chose them)."""
        return replace(self, checkpointing=(setup.checkpointing,), activation_offload=(setup.activation_offload,))


@dataclass(frozen=True)
class Search:
    """Every candidate tried (fitting or not), and whether a time model priced them."""

    candidates: tuple[PlannedRun, ...]
    timed: bool

    @property
    def ranked(self) -> tuple[PlannedRun, ...]:
        """The candidates that fit, fastest first (without a time model: in the order tried)."""
        fitting = [run for run in self.candidates if run.fits]
        if not self.timed:
            return tuple(sorted(fitting, key=lambda run: run.order))
        return tuple(sorted(fitting, key=lambda run: (float(f"{run.step_s:.9g}"), run.order)))

    @property
    def best(self) -> Optional[PlannedRun]:
        ranked = self.ranked
        return ranked[0] if ranked else None

    def like(self, run: PlannedRun, fitting: bool = False, **changes) -> Optional[PlannedRun]:
        """The first-ranked candidate with ``run``'s levers but ``changes`` (``plan="ddp"``), among
        all candidates or, with ``fitting``, those that fit; None when none was tried."""
        wanted = {**run.levers(), **changes}
        pool = self.ranked if fitting else sorted(self.candidates, key=lambda r: (not r.fits, r.order))
        return next((r for r in pool if all(r.levers()[k] == v for k, v in wanted.items())), None)


def splits(per_rank_batch: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs whose product is the per-rank batch, largest micro-batch first.

    >>> splits(8)
    [(8, 1), (4, 2), (2, 4), (1, 8)]
    """
    return [(b, per_rank_batch // b) for b in range(per_rank_batch, 0, -1) if per_rank_batch % b == 0]


def _first(value, values: tuple) -> tuple:
    return (value,) + tuple(v for v in values if v != value)


def _with_reshard(inputs: MemoryInputs, reshard: bool) -> MemoryInputs:
    """``inputs`` with stage 3 resharding after forward or not (the exact model's option too)."""
    exact = inputs.exact
    if exact is not None and exact.options.reshard_after_forward != reshard:
        exact = replace(exact, options=replace(exact.options, reshard_after_forward=reshard))
    return replace(inputs, exact=exact)


def search(result, request=None, levers: Levers = Levers()) -> Search:
    """Every combination of the levers for the memory estimate ``result``, priced on
    ``request``'s cluster (a ``TimingRequest``; None: memory only, ranked by the order tried).

    The batch per rank per optimizer step is ``micro_batch x grad_accum`` (the request's
    accumulation when given, else the setup's).
    """
    setup, inputs = result.setup, with_fractions(result.memory_inputs)
    accumulation = request.grad_accum if request is not None else setup.grad_accum
    ours = isinstance(inputs.engine, ShardEngine)
    offloads = _first(setup.activation_offload, levers.activation_offload) if ours else (setup.activation_offload,)
    reshards = _first(setup.reshard_after_forward, levers.reshard_after_forward) if ours \
        else (setup.reshard_after_forward,)
    candidates: list[PlannedRun] = []
    for policy in _first(setup.checkpointing, levers.checkpointing):
        for offload in offloads:
            for micro, accum in splits(setup.micro_batch * accumulation)[:levers.max_splits]:
                for reshard in reshards:
                    trial = replace(setup, checkpointing=policy, activation_offload=offload, micro_batch=micro,
                                    grad_accum=accum, reshard_after_forward=reshard)
                    trial_inputs = _with_reshard(inputs.with_setup(trial), reshard)
                    plans = tuple(p for p in all_plans(trial_inputs) if reshard or p.stage == 3)
                    candidates += _priced(result, trial_inputs, plans, request, len(candidates))
    if levers.device_budget and ours:
        candidates += _budget_refinement(result, request, candidates, inputs)
    return Search(tuple(candidates), request is not None)


def _priced(result, inputs: MemoryInputs, plans: tuple[PlanEstimate, ...], request, order: int) -> list[PlannedRun]:
    """``plans`` (under ``inputs``' setup) as candidate runs, timed on ``request`` when given
    (hybrid plans added by the time model too)."""
    setup = inputs.setup
    trial = replace(result, setup=setup, plans=plans, engine_model=inputs.engine, exact_engine=inputs.exact)
    if request is None:
        timed = [(plan, None, result.world_size) for plan in plans]
    else:
        from .timed import time_estimate

        priced = time_estimate(trial, replace(request, grad_accum=setup.grad_accum, objective="least-sharded"))
        timed = list(zip(priced.plans, priced.times, priced.group_sizes))
    return [PlannedRun(plan.name, plan.stage, plan.offload, group, setup.checkpointing, setup.micro_batch,
                       setup.grad_accum, time.step_s if time else math.nan, time.tokens_per_s if time else math.nan,
                       plan.total, setup.activation_offload, setup.reshard_after_forward, plan.host_bytes_per_node,
                       plan.disk_bytes_per_node, plan.verdict, order + index, plan)
            for index, (plan, time, group) in enumerate(timed)]


def _budget_refinement(result, request, candidates: list[PlannedRun], inputs: MemoryInputs) -> list[PlannedRun]:
    """The best pick, when it keeps parameters on the host, with as many units resident as fit
    (see [Note: stage="auto" offloads only the parameters it must] in device_budget.py)."""
    best = Search(tuple(candidates), request is not None).best
    if best is None or best.shard_group_size != result.world_size:
        return []
    spec = plan_spec(best.plan)
    if not (spec.offload_params or spec.partial_params) or spec.disk:
        return []
    trial = replace(result.setup, checkpointing=best.checkpointing, activation_offload=best.activation_offload,
                    micro_batch=best.micro_batch, grad_accum=best.grad_accum,
                    reshard_after_forward=best.reshard_after_forward)
    trial_inputs = _with_reshard(inputs.with_setup(trial), best.reshard_after_forward)
    found = largest_device_budget(result, trial_inputs)
    if found is None:
        return []
    refined = replace(_priced(result, trial_inputs, (found[1],), request, best.order - 1)[0],  # ahead on a tie
                      refined_from=best.plan)
    return [refined] if refined.fits and (not refined.timed or refined.step_s <= best.step_s) else []
