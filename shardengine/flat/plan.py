"""Which parameters share a flat bucket, decided from the module alone.

Pure planning (no tensors allocated, works on a meta-device module), shared by
the engine, which builds its buckets from it, and by the memory estimator,
which uses it to predict the engine's bytes per rank exactly, padding
included.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
>>> counts = count_elements(net, world_size=4, shape=BucketShape(cut_at_units=True))  # stage 2
>>> counts.trainable, counts.padded, counts.shard
(26, 28, 7)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from .layout import FlatLayout, split_into_buckets
from .owner_layout import plan_whole_tensor_buckets
from .units import find_units

DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class BucketPlan:
    """Parameters of one flat bucket, with the optimizer param group they belong to."""

    params: list[nn.Parameter]
    group_index: Optional[int]
    unit: Optional[str] = None  # stage 3: the unit that gathers this bucket


def _group_by_key(params: list[nn.Parameter], group_of: dict[int, int],
                  by_grad: bool) -> dict[tuple, list[nn.Parameter]]:
    """Parameters that may share a flat buffer: same param group, dtype (and requires_grad)."""
    grouped: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        key = (group_of.get(id(param)), param.dtype, param.requires_grad if by_grad else True)
        grouped.setdefault(key, []).append(param)
    return grouped


@dataclass(frozen=True)
class UnitCuts:
    """Stage 2: no bucket spans two units of this wrap policy (flat/units.py).

    [Note: stage 2's buckets end at unit boundaries]
    Stage 2 holds a bucket's full gradient only from its first gradient to its
    reduction, so the largest bucket bounds the unreduced gradient in backward, and
    the first one is allocated while the activations peak. With ``bucket_mb`` alone a
    model smaller than the cap is one bucket: its whole gradient, 2Ψ bytes at bf16,
    lives to the end of backward. Cutting the buckets also where a unit (a block of
    a ``ModuleList``, the same units stage 3 gathers) ends bounds it by a block, as
    FSDP's SHARD_GRAD_OP does by reducing each unit after its backward; large blocks
    are still cut by ``bucket_mb``. Stages 0-1 keep persistent full gradients, so
    their bucket sizes move no memory and they keep ``bucket_mb`` alone.
    """

    wrap: Optional[tuple[type, ...]] = None
    wrap_min_params: Optional[int] = None

    def unit_of(self, module: nn.Module) -> dict[int, int]:
        """id(param) -> index of its unit (the root last)."""
        return {id(p): index for index, (_, _, params) in enumerate(find_units(module, self.wrap,
                                                                               self.wrap_min_params))
                for p in params}


def _runs_by_unit(params: list[nn.Parameter], unit_of: Optional[dict[int, int]]) -> list[list[int]]:
    """Indices of ``params`` in runs of consecutive parameters of one unit (one run without cuts)."""
    runs: list[list[int]] = []
    for index, param in enumerate(params):
        if runs and (unit_of is None or unit_of[id(param)] == unit_of[id(params[runs[-1][-1]])]):
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def plan_replicated_buckets(module: nn.Module, group_of: dict[int, int], bucket_bytes: int,
                            whole_tensor_groups: frozenset[int] = frozenset(),
                            world_size: int = 1, unit_cuts: Optional[UnitCuts] = None) -> list[BucketPlan]:
    """Stages 0-2: trainable, non-empty parameters in reverse registration order
    (≈ the order backward produces their gradients), cut into size-capped buckets,
    and with ``unit_cuts`` (stage 2) also where a unit ends.
    Groups in ``whole_tensor_groups`` (stages 1-2 pass them) are bucketed by shape
    instead, see :func:`~shardengine.flat.owner_layout.plan_whole_tensor_buckets`."""
    params = [p for p in module.parameters() if p.requires_grad and p.numel() > 0][::-1]
    unit_of = unit_cuts.unit_of(module) if unit_cuts is not None else None
    plans = []
    for key, grouped in _group_by_key(params, group_of, by_grad=False).items():
        elements = max(1, bucket_bytes // grouped[0].element_size())
        for run in _runs_by_unit(grouped, unit_of):
            same = [grouped[i] for i in run]
            if key[0] in whole_tensor_groups:
                cut = plan_whole_tensor_buckets([(p.numel(), tuple(p.shape)) for p in same], world_size, elements)
            else:
                cut = split_into_buckets([p.numel() for p in same], elements)
            plans += [BucketPlan([same[i] for i in indices], key[0]) for indices in cut]
    return plans


def plan_unit_buckets(module: nn.Module, group_of: dict[int, int], wrap, wrap_min_params
                      ) -> list[tuple[nn.Module, str, list[BucketPlan]]]:
    """Stage 3: per unit (root last), one bucket per (param group, dtype, requires_grad)."""
    planned = []
    for unit_module, name, params in find_units(module, wrap, wrap_min_params):
        params = [p for p in params if p.numel() > 0]
        buckets = [BucketPlan(same, key[0], name)
                   for key, same in _group_by_key(params, group_of, by_grad=True).items()]
        planned.append((unit_module, name, buckets))
    return planned


@dataclass(frozen=True)
class ElementCounts:
    """Element counts the engine will hold for a module (trainable parameters only)."""

    trainable: int       # Ψ: unique trainable parameter elements
    padded: int          # Σ over buckets of the padded flat size (stages 0-2 hold this)
    shard: int           # Σ over buckets of one rank's slice (sharded terms)
    owned: int           # Σ over buckets of rank 0's slice without padding (the most any rank
                         # holds of real elements: per-parameter optimizer state, see flat/bucket.py)
    frozen: int          # unique frozen parameter elements
    frozen_shard: int    # stage 3: one rank's slice of the frozen buckets
    largest_unit: int    # stage 3: padded elements of the largest unit (working set)


@dataclass(frozen=True)
class BucketShape:
    """How a stage cuts its buckets (``StageSpec.bucket_shape`` says which, per stage).

    ``per_unit``: each wrap unit's parameters make its own buckets (stage 3); else buckets
    fill up to the bucket size in module order, and with ``cut_at_units`` they also end
    where a unit ends (stage 2: [Note: stage 2's buckets end at unit boundaries])."""

    per_unit: bool = False
    cut_at_units: bool = False


def count_elements(module: nn.Module, world_size: int, shape: BucketShape = BucketShape(),
                   bucket_mb: float = DEFAULT_BUCKET_MB, wrap=None, wrap_min_params=None,
                   group_of: Optional[dict[int, int]] = None) -> ElementCounts:
    """What the engine's flat buckets, cut as ``shape`` says, will hold for ``module`` on
    ``world_size`` ranks."""
    group_of = group_of if group_of is not None else {id(p): 0 for p in module.parameters()}
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    if not shape.per_unit:
        cuts = UnitCuts(wrap, wrap_min_params) if shape.cut_at_units else None
        layouts = [FlatLayout.build([p.shape for p in b.params], world_size)
                   for b in plan_replicated_buckets(module, group_of, int(bucket_mb * 2**20), unit_cuts=cuts)]
        trainable = [(lay, True) for lay in layouts]
        largest = 0
    else:
        units = plan_unit_buckets(module, group_of, wrap, wrap_min_params)
        trainable, largest = [], 0
        for _, _, buckets in units:
            layouts = [(FlatLayout.build([p.shape for p in b.params], world_size),
                        b.params[0].requires_grad) for b in buckets]
            trainable += layouts
            largest = max(largest, sum(lay.padded_numel for lay, _ in layouts))
    grad_layouts = [lay for lay, grad in trainable if grad]
    frozen_layouts = [lay for lay, grad in trainable if not grad]
    return ElementCounts(
        trainable=sum(lay.numel for lay in grad_layouts),
        padded=sum(lay.padded_numel for lay in grad_layouts),
        shard=sum(lay.shard_numel for lay in grad_layouts),
        owned=sum(min(lay.shard_numel, lay.numel) for lay in grad_layouts),
        frozen=frozen,
        frozen_shard=sum(lay.shard_numel for lay in frozen_layouts),
        largest_unit=largest)
