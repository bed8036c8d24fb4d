"""Optimizers: checking what the user passed, and rebuilding it over owned shards.

At stages >= 1 each rank steps only the slice of each flat bucket it owns. That
is exact only for *element-wise* optimizers, whose update of one element reads
only that element's gradient and state: then splitting a tensor anywhere
changes nothing. The rebuilt optimizer is a plain instance of the user's class
with the same param groups (same order, same hyperparameters), so LR
schedulers and ``param_groups`` edits keep working.

[Note: the whole-tensor optimizer seam]
What an optimizer steps is decided in three places, each a seam an optimizer
that must see a parameter's *full* gradient (Muon's orthogonalization,
Adafactor's row/column factors) plugs into without touching the stages:

1. *Which* optimizers: ``check_shardable`` below accepts element-wise classes
   (``ELEMENTWISE_OPTIMIZERS``); a whole-tensor class is recognised beside them
   (the ``matrixopt`` branch: ``optim/whole_tensor.py``, ``WHOLE_TENSOR_OPTIMIZERS``
   and the ``whole_tensor_optimizers=`` option), and the indices of the param
   groups it steps are handed to the engine at construction.
2. *Where* each parameter's elements live: the bucket's layout
   (flat/layout.py, chosen in ``DataParallel._new_bucket``, stages/base.py).
   The plain layout cuts the flat bucket into N equal slices wherever they
   fall; for a whole-tensor group the owner layout (``flat/owner_layout.py`` on
   ``matrixopt``) places every parameter whole inside one rank's slice, so the
   reduce-scatter, the all-gather and checkpoints stay unchanged.
3. *What* the optimizer is rebuilt over: ``FlatBucket.split_master`` gives one
   ``nn.Parameter`` per parameter fragment of the owned slice, and
   :func:`rebuild_over` builds the user's class over those. Under the owner
   layout a fragment is a whole parameter, given its real shape, so the rank
   that owns it computes the matrix update alone and the others receive the
   result in the all-gather they run anyway.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Union

import torch
from torch import nn

from ..errors import ConfigError

# Update of element i reads only element i of the gradient and of the state.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam",
     "ASGD", "Rprop") if hasattr(torch.optim, name))

OptimizerArg = Union[torch.optim.Optimizer, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]]


def resolve_optimizer(optimizer: OptimizerArg, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer instance (calling a factory on the model's parameters)."""
    if optimizer is None:
        raise ConfigError("an optimizer (instance or factory) is required")
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a factory, got "
                              f"{type(optimizer).__name__}")
        optimizer = optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer factory returned {type(optimizer).__name__}, "
                              "not a torch.optim.Optimizer")
    _check_params_in_model(optimizer, model)
    return optimizer


def _check_params_in_model(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    model_params = {id(p) for p in model.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in model_params:
                raise ConfigError(f"optimizer param group {index} holds a parameter of shape "
                                  f"{tuple(param.shape)} that is not a parameter of the model")


def group_index_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(param) -> index of its param group``."""
    return {id(p): index for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]}


def check_shardable(optimizer: torch.optim.Optimizer, allow_unknown: bool) -> None:
    if optimizer.state:
        raise ConfigError("the optimizer already has state (it has stepped); shard the model "
                          "and optimizer before the first step")
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or allow_unknown:
        return
    raise ConfigError(
        f"{type(optimizer).__name__} is not known to be element-wise. Stages >= 1 split "
        "parameters into flat 1/N slices, so an optimizer that looks at whole tensors or at the "
        "whole model (LBFGS's line search, Adafactor's row/column factors, Muon's matrix "
        "orthogonalization) would compute different updates. Use stage=0, or pass "
        "allow_unknown_optimizer=True if your optimizer really is element-wise. Known "
        f"element-wise: {[cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS]}")


def rebuild_over(optimizer: torch.optim.Optimizer,
                 params_per_group: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    """A new instance of ``optimizer``'s class with each group's params replaced."""
    groups = []
    for group, params in zip(optimizer.param_groups, params_per_group):
        hyper = {key: value for key, value in group.items() if key != "params"}
        groups.append({**hyper, "params": params})
    # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay);
    # the groups carry every hyperparameter anyway.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return type(optimizer)(groups, **defaults)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer's state (each storage counted once)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value) and name != "step":  # the step counter is a scalar
                key = value.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total
