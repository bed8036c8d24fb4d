"""Which stage-3 units keep their states on the host under a fraction or a device budget.

The choice itself is pure and shared with the estimator (flat/residency.py, [Note:
which units stay resident]); this module gives it the engine's facts: each
bucket plan's dtypes as ``shard()`` will cast them, where a resident unit's
optimizer lives (``offload_optimizer``), and for a budget how many state tensors the
user's optimizer keeps per parameter (optim/state_size.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import ConfigError
from ..flat.plan import BucketPlan
from ..flat.residency import BucketShare, bucket_shares, offloaded_units, resident_bytes_per_element, unit_size
from ..optim.state_size import member_of, state_tensors_per_param
from ..policies import Offload

PlannedUnit = tuple[nn.Module, str, list[BucketPlan]]


@dataclass(frozen=True)
class ResidentUnitCost:
    """The facts a resident unit's device bytes follow from, as ``shard()`` will build it."""

    param_dtype: Optional[torch.dtype]   # the compute dtype floating parameters are cast to (None: kept)
    grad_dtype: Optional[torch.dtype]    # the gradients' dtype (None: the parameter's)
    separate_master: bool                # an fp32 master is kept apart from the parameters
    optimizer_on_device: bool            # a resident unit's optimizer state is on the device
    sizing_optimizer: Optional[torch.optim.Optimizer]  # the user's, read to count its state tensors


def offloaded_unit_indices(planned: list[PlannedUnit], offload: Offload, group_size: int,
                           resident: ResidentUnitCost) -> frozenset[int]:
    """Indices into ``planned`` of the units on the host; none unless a fraction or budget is set
    (with ``offload_params=True`` the engine's one storage plan already puts every unit there)."""
    if not offload.partial_params:
        return frozenset()
    fraction = offload.params if isinstance(offload.params, float) else None
    per_element = (lambda bucket: 0) if fraction is not None else _resident_cost(resident)
    sizes = [unit_size(bucket_shares(plans, group_size), per_element) for _, _, plans in planned]
    return offloaded_units(sizes, fraction=fraction, budget=offload.device_budget)


def _resident_cost(resident: ResidentUnitCost) -> Callable[[BucketShare], int]:
    """Device bytes per shard element of a bucket kept resident (flat/residency.py)."""
    per_group: dict[Optional[int], int] = {}  # one scratch step per param group, not per bucket

    def cost(share: BucketShare) -> int:
        dtype = (resident.param_dtype if share.dtype.is_floating_point else None) or share.dtype
        trained = share.trained
        if trained and share.group not in per_group:
            per_group[share.group] = _state_tensors(resident.sizing_optimizer, share.group)
        states = per_group[share.group] if trained else 0
        return resident_bytes_per_element(
            trained, dtype.itemsize, (resident.grad_dtype or dtype).itemsize,
            torch.float32.itemsize if resident.separate_master else dtype.itemsize, states,
            resident.optimizer_on_device)

    return cost


def _state_tensors(optimizer: Optional[torch.optim.Optimizer], group: Optional[int]) -> int:
    count = state_tensors_per_param(optimizer, group) if optimizer is not None else 0
    if count is None:
        raise ConfigError(f"offload_device_budget counts the optimizer's state, known for torch's "
                          f"element-wise optimizers; {type(member_of(optimizer, group)[0]).__name__} is not "
                          "one of them. Give the fraction of the parameters to put on the host instead "
                          "(offload_params=0.5)")
    return count
