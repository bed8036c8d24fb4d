"""Optimizers: checking what the user passed, and rebuilding it over owned shards.

At stages >= 1 each rank steps only the slice of each flat bucket it owns. That
is exact only for *element-wise* optimizers, whose update of one element reads
only that element's gradient and state: then splitting a tensor anywhere
changes nothing. Optimizers that must see whole tensors plug in at the seam below.

[Note: the user's optimizer object is the one that steps]
Users build the optimizer and its LR scheduler together, then wrap
(``sched = LambdaLR(opt, ...); model, opt = se.shard(net, opt)``, the Hugging
Face / DeepSpeed order), and loggers read ``opt.param_groups[0]["lr"]``. A new
optimizer instance would leave all of those holding a stale object: the
schedule would silently stop reaching the steps. So the user's own instance
is re-pointed at the shards: each param group dict (the very object the
scheduler writes ``lr`` into) keeps its hyperparameters and gets the owned
pieces as its ``params``. Nothing else in a torch optimizer depends on which
tensors it holds before its first step (state is keyed by tensor and still
empty; ``check_shardable`` refuses one that has stepped).

[Note: the whole-tensor optimizer seam]
What an optimizer steps is decided in three places, each a seam an optimizer
that must see a parameter's *full* gradient (Muon's orthogonalization,
Adafactor's row/column factors) plugs into without touching the stages:

1. *Which* optimizers: ``check_shardable`` below accepts element-wise classes
   (``ELEMENTWISE_OPTIMIZERS``) and whole-tensor ones (``WHOLE_TENSOR_OPTIMIZERS``
   in optim/whole_tensor.py, plus the ``whole_tensor_optimizers=`` option); the
   indices of the param groups a whole-tensor optimizer steps are handed to the
   engine at construction (``whole_tensor_groups``, stages/engine.py).
2. *Where* each parameter's elements live: the bucket's layout, chosen in
   ``new_bucket`` (stages/buckets.py). The plain layout
   (flat/layout.py) cuts the flat bucket into N equal slices wherever they
   fall; for a whole-tensor group the owner layout (flat/owner_layout.py)
   places every parameter whole inside one rank's slice, so the reduce-scatter,
   the all-gather and checkpoints stay unchanged.
3. *What* the optimizer steps: ``FlatBucket.split_master`` gives one
   ``nn.Parameter`` per parameter fragment of the owned slice, and
   :func:`repoint_over` points the user's optimizer at those. Under the owner
   layout a fragment is a whole parameter, given its real shape, so the rank
   that owns it computes the matrix update alone and the others receive the
   result in the all-gather they run anyway.

A new whole-tensor optimizer needs only step 1 (a class in
``WHOLE_TENSOR_OPTIMIZERS`` or the option); one with another granularity (a
block of rows, a group of tensors) is a new layout at step 2.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from ..errors import ConfigError
from .optimizer_list import OptimizerList
from .whole_tensor import WHOLE_TENSOR_OPTIMIZERS, inner_optimizers, is_whole_tensor

# Update of element i reads only element i of the gradient and of the state.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam",
     "ASGD", "Rprop") if hasattr(torch.optim, name))

OptimizerArg = Union[torch.optim.Optimizer, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]]


def resolve_optimizer(optimizer: OptimizerArg, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer instance (calling a factory on the model's parameters); a list or
    tuple of optimizers over disjoint parameters becomes one :class:`OptimizerList`."""
    if optimizer is None:
        return forward_only_optimizer(model)
    if isinstance(optimizer, (list, tuple)):
        names = {id(p): name for name, p in model.named_parameters()}
        optimizer = OptimizerList(optimizer, names)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, a list of them or a factory, got "
                              f"{type(optimizer).__name__}")
        optimizer = optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer factory returned {type(optimizer).__name__}, "
                              "not a torch.optim.Optimizer")
    _check_params_in_model(optimizer, model)
    return optimizer


def forward_only_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """What ``shard(model, None)`` steps: nothing. A forward-only model (a frozen reference or
    teacher) has no trainable parameter; the engine then holds every parameter as frozen
    (at stage 3: sharded, gathered unit by unit for each forward and freed after)."""
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if trainable:
        shown = ", ".join(trainable[:5]) + (f" and {len(trainable) - 5} more" if len(trainable) > 5 else "")
        raise ConfigError(f"shard(model, None) shards a forward-only model, but {shown} require grad: "
                          "freeze the model first (model.requires_grad_(False)), or pass an optimizer to train it")
    return torch.optim.SGD([{"params": []}], lr=0.0)


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


def check_shardable(optimizer: torch.optim.Optimizer, allow_unknown: bool,
                    whole_tensor: tuple[type, ...] = ()) -> None:
    """Each optimizer (each member of a list) is element-wise, whole-tensor, or allowed."""
    for member in inner_optimizers(optimizer):
        _check_one_shardable(member, allow_unknown, whole_tensor)


def _check_one_shardable(optimizer: torch.optim.Optimizer, allow_unknown: bool,
                         whole_tensor: tuple[type, ...]) -> None:
    if not unstepped(optimizer):
        raise ConfigError("the optimizer already has state (it has stepped); shard the model "
                          "and optimizer before the first step")
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or is_whole_tensor(optimizer, whole_tensor) \
            or allow_unknown:
        return
    raise ConfigError(
        f"{type(optimizer).__name__} is not known to be element-wise or whole-tensor. Stages >= 1 "
        "split parameters into flat 1/N slices for element-wise optimizers, so an optimizer that "
        "looks at the whole model (LBFGS's line search) or at whole tensors would compute "
        "different updates. If its update of a parameter reads only that parameter's gradient "
        "and state (as Muon's or Adafactor's), declare it: whole_tensor_optimizers=(YourClass,); "
        "each parameter is then stepped whole on one rank. Else use stage=0, or pass "
        "allow_unknown_optimizer=True if it really is element-wise. Known element-wise: "
        f"{[cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS]}; whole-tensor: "
        f"{[cls.__name__ for cls in WHOLE_TENSOR_OPTIMIZERS]}")


def repoint_over(optimizer: torch.optim.Optimizer,
                 params_per_group: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    """``optimizer`` itself, each param group now holding ``params_per_group[i]`` (see the Note).
    An :class:`OptimizerList` is re-pointed member by member (each over its own groups)."""
    if len(params_per_group) != len(optimizer.param_groups):
        raise ConfigError(f"internal: {len(params_per_group)} lists of shards for "
                          f"{len(optimizer.param_groups)} param groups")
    if isinstance(optimizer, OptimizerList):
        first = 0
        for member in optimizer.optimizers:
            count = len(member.param_groups)
            repoint_over(member, params_per_group[first:first + count])
            first += count
        return optimizer
    made_in_init = bool(optimizer.state)  # unstepped (check_shardable): Adagrad's accumulators
    for group, params in zip(optimizer.param_groups, params_per_group):
        group["params"] = list(params)
    optimizer.state.clear()  # keyed by the old tensors
    if made_in_init:
        _initial_state_over(optimizer)
    return optimizer


def unstepped(optimizer: torch.optim.Optimizer) -> bool:
    """No state, or only what the constructor made before any step (Adagrad fills ``sum`` and a
    zero ``step`` per parameter in ``__init__``; torch's other optimizers start their state lazily)."""
    return all("step" in state and float(state["step"]) == 0 for state in optimizer.state.values())


def _initial_state_over(optimizer: torch.optim.Optimizer) -> None:
    """The state the optimizer's constructor makes in ``__init__``, made for the pieces it now
    holds: its class built again over the same groups and hyperparameters, its state taken over."""
    groups = [dict(group) for group in optimizer.param_groups]
    try:
        twin = type(optimizer)(groups, **optimizer.defaults)
    except TypeError as error:
        raise ConfigError(
            f"{type(optimizer).__name__} made its state in __init__ (before any step), and building it "
            f"again over the shards from its defaults failed ({error}); use stage=0 for it") from error
    optimizer.state.update(twin.state)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, only: Optional[set[int]] = None) -> int:
    """Bytes of tensors in the optimizer's state (each storage counted once); ``only``: of the
    parameters with these ids alone."""
    seen, total = set(), 0
    for param, state in optimizer.state.items():
        if only is not None and id(param) not in only:
            continue
        for name, value in state.items():
            if torch.is_tensor(value) and name != "step":  # the step counter is a scalar
                key = value.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total
