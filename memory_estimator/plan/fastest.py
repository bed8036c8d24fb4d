"""``--objective fastest``: the fastest plan that fits, over everything a run can choose.

For a fixed global batch (``micro_batch x grad_accum`` sequences per rank per optimizer
step, as given), :func:`fastest_plan` asks the one planner (``search.py``, see [Note: one
planner over every lever]) for the fastest run that fits the device, the host and the
disk: every checkpointing policy of :data:`POLICIES`, activation offload and resharding
after forward (shardengine), every split of that batch into micro-batch x accumulation,
and every plan the time model prices (stages 0-3, offload, shardengine's fractional
offload at ``candidates.FRACTIONS``, hybrid sharding groups at the stages the engine runs
them). Ties go to the cheaper levers (the order tried).

[Note: one plan, one answer]
The recommended plan and its largest micro-batch in the text and the JSON always refer
to the same plan: the objective's pick. :func:`retarget` rewrites a
memory estimate's recommendation to the timed pick before anything is printed.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..terms.model_states import plan_spec
from .candidates import FRACTIONS, with_candidate_plans, with_fractions  # noqa: F401 (re-exported)
from .memory import largest_fitting, plan_fits_with
from .search import POLICIES, Levers, PlannedRun, search, splits  # noqa: F401 (re-exported)
from .timed import TimedEstimate, TimingRequest


def fastest_plan(result, request: TimingRequest, levers: Levers = Levers()) -> Optional[PlannedRun]:
    """The fastest run that fits for the memory estimate ``result`` on ``request``'s cluster, over
    every lever (``search.py``) and the splits of its per-rank batch (``micro_batch x request.grad_accum``).

    >>> from memory_estimator import estimate
    >>> result = estimate(params=1e9, hidden=2048, layers=16, heads=16, vocab=32000, world_size=8,
    ...                   micro_batch=2, seq_len=2048, device="H100-80GB")
    >>> run = fastest_plan(result, TimingRequest(nodes=1, gpus_per_node=8, grad_accum=2))
    >>> run.micro_batch * run.grad_accum, run.step_s > 0
    (4, True)
    """
    return search(result, request, levers).best


def retarget(result, name: Optional[str], group_size: Optional[int] = None):
    """The estimate with ``name`` recommended and the largest micro-batch that fits *it*."""
    if name == result.recommended:
        return result
    if name is None:
        return replace(result, recommended=None, max_micro_batch=None)
    stage = int(name[4]) if name.startswith("zero") else 0
    hybrid = "-hsdp" in name
    spec = plan_spec(f"zero{stage}" if hybrid else name)
    if result.model is None or result.model.source == "not estimated" or result.model.unmodelled:
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
