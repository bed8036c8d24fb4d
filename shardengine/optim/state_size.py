"""How many optimizer-state tensors shaped like a parameter an optimizer keeps for it.

A device budget (``Offload(device_budget=...)``, flat/residency.py) is decided at
``shard()``, before the optimizer's first step creates any state, yet must count that
state. Torch's element-wise optimizers create it lazily, per parameter, from their
param group's hyperparameters alone (Adam: ``exp_avg`` and ``exp_avg_sq``, plus
``max_exp_avg_sq`` with ``amsgrad``; SGD: ``momentum_buffer`` only with momentum),
so one step of a scratch optimizer of the same class over a three-element
parameter, with the group's hyperparameters, shows the count exactly, whatever the
torch version adds. The scratch optimizer is the class's own step without torch's
hooks (a user's global step hooks must not see it), and the user's optimizer is
only read.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .bucketed_step import unhooked_step
from .rebuild import ELEMENTWISE_OPTIMIZERS
from .whole_tensor import inner_optimizers

_PROBE = 3  # elements: apart from the 0-dim scalars (Adam's step, ASGD's eta and mu)


def state_tensors_per_param(optimizer: torch.optim.Optimizer, group_index: Optional[int]) -> Optional[int]:
    """State tensors shaped like the parameter that ``optimizer`` keeps for one in param group
    ``group_index`` (a container's groups concatenated); 0 for no group (never stepped); None
    when not known: a class other than torch's element-wise ones.

    >>> state_tensors_per_param(torch.optim.Adam([nn.Parameter(torch.ones(2))]), 0)
    2
    >>> state_tensors_per_param(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), 0)
    0
    """
    if group_index is None:
        return 0
    member, local = member_of(optimizer, group_index)
    if type(member) not in ELEMENTWISE_OPTIMIZERS:
        return None
    hyper = {key: value for key, value in member.param_groups[local].items() if key != "params"}
    probe = nn.Parameter(torch.zeros(_PROBE))
    probe.grad = torch.ones(_PROBE)
    scratch = type(member)([{"params": [probe], **hyper}])
    unhooked_step(scratch)()
    return sum(1 for value in scratch.state[probe].values() if torch.is_tensor(value) and value.numel() == _PROBE)


def member_of(optimizer: torch.optim.Optimizer, group_index: int) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer (a container's member) holding param group ``group_index``, and the
    group's index in it."""
    for member in inner_optimizers(optimizer):
        if group_index < len(member.param_groups):
            return member, group_index
        group_index -= len(member.param_groups)
    raise IndexError(f"no param group {group_index}")
