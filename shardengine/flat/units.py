"""Stage-3 units: the submodules whose full parameters are gathered together.

Default policy: every element of an ``nn.ModuleList`` (the repeated blocks of
a transformer), plus any module of a ``wrap`` class or with at least
``wrap_min_params`` parameters; the root takes whatever is left. Units do not
nest: a module inside a unit belongs to it.

A parameter registered by modules of two different units (tied weights, e.g.
the input embedding and the output projection) belongs to the root, so it is
held once, gathered once, and never needs a gradient from two units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .bucket import FlatBucket


@dataclass(eq=False)
class Unit:
    module: nn.Module
    name: str
    buckets: list[FlatBucket]

    @property
    def grad_buckets(self) -> list[FlatBucket]:
        return [b for b in self.buckets if b.requires_grad]

    @property
    def has_frozen(self) -> bool:
        return any(not b.requires_grad for b in self.buckets)

    @property
    def grad_param_count(self) -> int:
        return sum(len(b.params) for b in self.grad_buckets)


def _is_unit(module: nn.Module, in_module_list: bool, wrap: Optional[tuple[type, ...]],
             min_params: Optional[int]) -> bool:
    if wrap is not None and isinstance(module, wrap):
        return True
    if min_params is not None and sum(p.numel() for p in module.parameters()) >= min_params:
        return True
    return wrap is None and in_module_list


def _unit_roots(root: nn.Module, wrap, min_params) -> list[tuple[str, nn.Module]]:
    """Top-most modules below ``root`` that are units, in registration order."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if _is_unit(child, isinstance(module, nn.ModuleList), wrap, min_params):
                found.append((path, child))
            else:
                visit(path, child)

    visit("", root)
    return found


def find_units(root: nn.Module, wrap: Optional[tuple[type, ...]],
               min_params: Optional[int]) -> list[tuple[nn.Module, str, list[nn.Parameter]]]:
    """``(module, name, params)`` per unit, the root last; every parameter exactly once."""
    units = _unit_roots(root, wrap, min_params)
    owners: dict[int, set[int]] = {}  # id(param) -> indices of units registering it
    params_by_id: dict[int, nn.Parameter] = {}
    for index, (_, module) in enumerate(units):
        for _, param in module.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), set()).add(index)
            params_by_id[id(param)] = param
    inside = {id(m) for _, unit in units for m in unit.modules()}
    for module in root.modules():
        if id(module) not in inside:
            for param in module.parameters(recurse=False):
                owners.setdefault(id(param), set()).add(len(units))  # the root
                params_by_id[id(param)] = param
    order = list(dict.fromkeys(id(p) for p in root.parameters()))
    result = []
    for index, (name, module) in enumerate(units + [("<root>", root)]):
        mine = [params_by_id[pid] for pid in order
                if owners[pid] == {index} or (index == len(units) and len(owners[pid]) > 1)]
        result.append((module, name, mine))
    return result


def root_entry_modules(root: nn.Module, units: list[Unit]) -> list[nn.Module]:
    """Modules below ``root``, outside every unit, that hold root-unit parameters
    (directly or through such modules): the ones that may be called on their own."""
    inside_units = {id(m) for unit in units[:-1] for m in unit.module.modules()}
    root_params = {id(p) for b in units[-1].buckets for p in b.params} if units else set()
    found = []

    def visit(module: nn.Module) -> bool:
        holds = any(id(p) in root_params for p in module.parameters(recurse=False))
        for child in module.children():
            if id(child) not in inside_units and visit(child):
                holds = True
        if holds and module is not root:
            found.append(module)
        return holds

    visit(root)
    return found


def in_backward() -> bool:
    """True while autograd is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Tensors in a module's output that will receive a gradient."""
    leaves, _ = tree_flatten(output)
    return (t for t in leaves if torch.is_tensor(t) and t.requires_grad)
