"""``--objective fastest``: the fastest plan that fits, over everything a run can choose.

For a fixed global batch (``micro_batch x grad_accum`` sequences per rank per optimizer
step, as given), the planner tries every checkpointing policy of :data:`POLICIES`, every
split of that batch into micro-batch x accumulation, and every plan the time model
prices (stages 0-3, offload, shardengine's fractional offload at ``candidates.FRACTIONS``, hybrid
sharding groups at the stages the engine runs them); it keeps the plans that fit and
returns the one with the least time per step. Ties go to the less sharded plan and the
cheaper recompute (the order tried).

[Note: one plan, one answer]
The recommended plan and its largest micro-batch in the text and the JSON always refer
to the same plan: the objective's pick. :func:`retarget` rewrites a
memory estimate's recommendation to the timed pick before anything is printed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..terms.model_states import plan_spec
from .candidates import FRACTIONS, with_candidate_plans, with_fractions  # noqa: F401 (FRACTIONS: re-exported)
from .memory import all_plans, largest_fitting, plan_fits_with
from .timed import TimedEstimate, TimingRequest, time_estimate

POLICIES = ("none", "selective:op", "full")


@dataclass(frozen=True)
class PlannedRun:
    """The fastest choice: plan (with its hybrid group), checkpointing, micro-batch, accumulation."""

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

    def to_json_dict(self) -> dict:
        return {"plan": self.plan, "stage": self.stage, "offload": self.offload,
                "shard_group_size": self.shard_group_size, "checkpointing": self.checkpointing,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "step_time_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "memory_bytes": int(self.memory_bytes)}

    def text(self) -> str:
        return (f"fastest that fits: {self.plan} (shard group {self.shard_group_size}), checkpointing "
                f"{self.checkpointing}, micro-batch {self.micro_batch} x accumulation {self.grad_accum}: "
                f"{self.step_s:.4g} s/step, {self.tokens_per_s:,.0f} tokens/s, {self.memory_bytes / 2**30:.2f} GiB")


def splits(per_rank_batch: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs whose product is the per-rank batch, largest micro-batch first.

    >>> splits(8)
    [(8, 1), (4, 2), (2, 4), (1, 8)]
    """
    return [(b, per_rank_batch // b) for b in range(per_rank_batch, 0, -1) if per_rank_batch % b == 0]


def fastest_plan(result, request: TimingRequest) -> Optional[PlannedRun]:
    """The fastest plan that fits for the memory estimate ``result`` on ``request``'s cluster, over
    checkpointing policies x splits of its per-rank batch (``micro_batch x request.grad_accum``).

    >>> from memory_estimator import estimate
    >>> result = estimate(params=1e9, hidden=2048, layers=16, heads=16, vocab=32000, world_size=8,
    ...                   micro_batch=2, seq_len=2048, device="H100-80GB")
    >>> run = fastest_plan(result, TimingRequest(nodes=1, gpus_per_node=8, grad_accum=2))
    >>> run.micro_batch * run.grad_accum, run.step_s > 0
    (4, True)
    """
    setup, inputs = result.setup, with_fractions(result.memory_inputs)
    per_rank = setup.micro_batch * request.grad_accum
    policies = (setup.checkpointing,) + tuple(p for p in POLICIES if p != setup.checkpointing)
    best = None
    for policy in policies:
        for micro, accum in splits(per_rank)[:6]:
            trial_setup = replace(setup, checkpointing=policy, micro_batch=micro, grad_accum=accum)
            plans = all_plans(inputs.with_setup(trial_setup))
            trial = replace(result, setup=trial_setup, plans=plans)
            timed = time_estimate(trial, replace(request, grad_accum=accum))
            for plan, time, group in zip(timed.plans, timed.times, timed.group_sizes):
                if not plan.fits:
                    continue
                candidate = PlannedRun(plan.name, plan.stage, plan.offload, group, policy, micro, accum,
                                       time.step_s, time.tokens_per_s, plan.total)
                if best is None or candidate.step_s < best.step_s * (1 - 1e-9):
                    best = candidate
    return best


def retarget(result, name: Optional[str], group_size: Optional[int] = None):
    """The estimate with ``name`` recommended and the largest micro-batch that fits *it*."""
    if name == result.recommended:
        return result
    if name is None:
        return replace(result, recommended=None, max_micro_batch=None)
    stage = int(name[4]) if name.startswith("zero") else 0
    hybrid = "-hsdp" in name
    spec = plan_spec(f"zero{stage}" if hybrid else name)
    if result.model is None or result.model.source == "not estimated":
        return replace(result, recommended=name, max_micro_batch=None)
    inputs = result.memory_inputs
    if hybrid:
        inputs = replace(inputs.analytic(), setup=replace(inputs.setup, world_size=group_size,
                                                          shard_numel_per_rank=None))
    fits = lambda b: plan_fits_with(spec, inputs.with_setup(replace(inputs.setup, micro_batch=b)))  # noqa: E731
    return replace(result, recommended=name, max_micro_batch=largest_fitting(fits, result.setup.micro_batch,
                                                                             limit=1 << 20))


def apply_objective(result, timed: Optional[TimedEstimate], request: Optional[TimingRequest]):
    """(estimate recommending the objective's pick, the planner's fastest run or None)."""
    if timed is None or request is None or timed.objective != "fastest":
        return result, None
    result = with_candidate_plans(result)  # the table lists what the objective chose among
    groups = dict(zip((p.name for p in timed.plans), timed.group_sizes))
    retargeted = retarget(result, timed.recommended, groups.get(timed.recommended))
    return retargeted, fastest_plan(result, request)
