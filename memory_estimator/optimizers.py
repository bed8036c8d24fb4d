"""Naming a live ``torch.optim`` optimizer the way the estimator does.

>>> import torch
>>> net = torch.nn.Linear(2, 2)
>>> optimizer_name(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
'sgd-momentum'
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .errors import EstimatorInputError

SUPPORTED = "torch.optim.Adam, AdamW and SGD (with or without momentum)"


def optimizer_name(optimizer: Any) -> str:
    """``"adamw"`` / ``"adam"`` / ``"sgd"`` / ``"sgd-momentum"`` for a torch optimizer instance.

    Raises :class:`EstimatorInputError` for optimizers whose state the estimator does
    not model (including Adam with ``amsgrad=True``, which keeps a third buffer).
    """
    import torch

    if isinstance(optimizer, str):
        return optimizer
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or groups is None:
        raise EstimatorInputError(f"optimizer must be a name or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        if any(group.get("amsgrad") for group in groups):
            raise EstimatorInputError(f"{kind.__name__}(amsgrad=True) keeps a third state buffer the estimator "
                                      f"does not model; supported: {SUPPORTED}")
        decoupled = kind is torch.optim.AdamW or any(group.get("decoupled_weight_decay") for group in groups)
        return "adamw" if decoupled else "adam"
    if kind is torch.optim.SGD:
        return "sgd-momentum" if any(group.get("momentum", 0) for group in groups) else "sgd"
    raise EstimatorInputError(f"the estimator does not model {kind.__name__}'s state; supported: {SUPPORTED}")


def group_index_by_name(optimizer: Any, module: nn.Module) -> dict[str, int] | None:
    """``parameter name -> param group index`` (names as ``module.named_parameters()`` gives them)."""
    if isinstance(optimizer, str):
        return None
    index_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return {name: index_of.get(id(p)) for name, p in module.named_parameters()}
