"""Rank workers for fractional parameter offload (``offload_params=<fraction>``,
``offload_device_budget=``): which units move, what ``memory_report()`` says, checkpoints
across tiers. Training against resident reuses param_offload_cases.py (same model and loop:
Adam, ``no_sync()`` accumulation, clipping)."""

from __future__ import annotations

import torch

from disk_offload_cases import VOCAB, _loss, _train
from param_offload_cases import HOST, _differ, _resumed, _shard

HALF = {"offload_params": 0.5}


def _elements(unit) -> int:
    return sum(p.numel() for bucket in unit.buckets for p in bucket.params)


def _moved(unit) -> bool:
    return any(bucket.param_home is not None for bucket in unit.buckets)


def choice_problems(fraction: float) -> list[str]:
    """The units on the host must be all but the longest run, from the root and then the blocks
    from the last, that keeps at most ``1 - fraction`` of the elements; every bucket of a unit
    on the same tier; and both tiers used (the model is sized for that)."""
    model, _ = _shard({"offload_params": fraction}, frozen=True)
    units = model.engine.layout.units
    total, kept, resident = sum(map(_elements, units)), 0, set()
    for unit in [units[-1]] + units[-2::-1]:  # the root is the last unit of the plan
        if kept + _elements(unit) > (1 - fraction) * total:
            break
        kept += _elements(unit)
        resident.add(unit.name)
    problems = [f"unit {u.name!r} split between tiers" for u in units
                if len({b.param_home is None for b in u.buckets}) > 1]
    got = {u.name for u in units if not _moved(u)}
    if got != resident:
        problems.append(f"resident units {sorted(got)}, the rule keeps {sorted(resident)}")
    if not resident or len(resident) == len(units):
        problems.append(f"the fraction {fraction} should keep some units and move others here")
    return problems


def _held_report(options: dict):
    """memory_report() after a step and one more backward (reduced gradients held)."""
    model, optimizer = _shard(options, frozen=True)
    _train(model, optimizer, steps=1)
    _loss(model, torch.randint(0, VOCAB, (3, 5))).backward()
    return model, model.memory_report()


def _masters(buckets) -> int:
    """The separate fp32 masters of the trained buckets."""
    return sum(b.master.numel() * b.master.element_size() for b in buckets if b.requires_grad and b.master_is_separate)


def _moments(buckets) -> int:
    """Adam's two moments of each stepped piece."""
    return sum(2 * sum(p.param.numel() * b.master.element_size() for p in b.master_pieces)
               for b in buckets if b.requires_grad)


def partial_reports(precision: dict) -> dict:
    """With half the parameters on the host: the report, the same run's bytes per tier counted
    from the buckets themselves, and the resident run's report."""
    model, report = _held_report({**HALF, **precision})
    by_tier = {}
    for tier, moved in (("host", True), ("device", False)):
        buckets = [b for b in model.engine.buckets if (b.param_home is not None) == moved]
        # a moved trained bucket's only parameter shard is its master: a host parameter
        masters = _masters(buckets)
        by_tier[tier] = {
            "params": sum(b.kept_shard.numel() * b.kept_shard.element_size()
                          for b in buckets if b.kept_shard is not None) + (masters if moved else 0),
            "grads": sum(b.grad_shard.numel() * b.grad_shard.element_size()
                         for b in buckets if b.grad_shard is not None),
            "optimizer_states": _moments(buckets) + (0 if moved else masters)}
    return {"report": report.as_dict(), "counted": by_tier,
            "resident": _held_report(dict(precision))[1].as_dict()}


def budget_reports(budgets: list) -> dict:
    """bf16 runs under each device budget: the report and the units moved to the host; with
    the resident run's and the all-on-host run's reports to compare against."""
    runs = []
    for budget in budgets:
        model, report = _held_report({"offload_device_budget": budget, "param_dtype": "bf16"})
        runs.append({"report": report.as_dict(), "moved": sum(map(_moved, model.engine.layout.units)),
                     "units": len(model.engine.layout.units)})
    return {"runs": runs, "resident": _held_report({"param_dtype": "bf16"})[1].as_dict(),
            "host": _held_report({**HOST, "param_dtype": "bf16"})[1].as_dict()}


def checkpoint_across_fractions(checkpoint: str, precision: dict) -> list[str]:
    """Saved with half the units on the host and resumed with all or none there, and back:
    the bits of the run resident throughout."""
    half, host, resident = {**HALF, **precision}, {**HOST, **precision}, dict(precision)
    want = _resumed(resident, resident, checkpoint + "-resident")
    differ = []
    for index, (before, after) in enumerate([(half, host), (host, half), (half, resident), (resident, half)]):
        differ += [f"{before} -> {after}: {name}"
                   for name in _differ(want, _resumed(before, after, f"{checkpoint}-{index}"))]
    return differ
