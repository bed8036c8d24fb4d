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

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..policies import forward_never_runs
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
    if forward_never_runs(type(module)):
        return False  # its hooks would never run: its children are the candidates (see _unit_roots)
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


def root_frozen_modules(root: nn.Module, units: list[Unit]) -> list[nn.Module]:
    """Modules outside every unit that hold frozen root-unit parameters themselves (a frozen final
    norm, a frozen head or embedding): their backward reads those parameters for the gradient of
    their input, which may be another unit's output (see unit_scheduler.py, [Note: the root unit
    holds the other units])."""
    inside_units = {id(m) for unit in units[:-1] for m in unit.module.modules()}
    frozen = {id(p) for b in units[-1].buckets if not b.requires_grad for p in b.params} if units else set()
    return [module for module in root.modules() if id(module) not in inside_units
            and any(id(p) in frozen for p in module.parameters(recurse=False))]


def in_backward() -> bool:
    """True while autograd is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(output: Any, objects: bool = False) -> Iterator[torch.Tensor]:
    """Tensors in a module's output (or inputs) that will receive a gradient, in order.

    [Note: tensors inside any output]
    Stage 3 frees a unit after its forward and gathers it again when a gradient
    reaches its outputs, through hooks on the output tensors; a tensor it does not
    find gets no hook, and backward then reads the freed weights (a crash inside
    autograd). So the walk goes beyond what ``torch.utils._pytree`` flattens (lists,
    tuples, dicts, namedtuples, registered classes): into the fields of a dataclass
    that is not registered (FSDP2 walks dataclasses too) and, with ``objects`` (a
    unit's outputs, where a hook too many only gathers early), the attributes of any
    other object (``__dict__``, ``__slots__``), each object once. Modules, types and
    functions are not data and are not entered. The model's own outputs and a unit's
    inputs are walked without ``objects``: a key/value cache object there holds
    tensors the logits derive from, which are not outputs (the fp16 loss scale would
    be applied to them too) nor inputs whose gradient a unit waits for.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Out:
    ...     hidden: torch.Tensor
    ...     extra: dict
    >>> t = torch.ones(2, requires_grad=True)
    >>> [x is t for x in tensors_in(Out(hidden=t * 1, extra={"a": t}))]
    [False, True]
    >>> class Cache:
    ...     def __init__(self, keys): self.keys = keys
    >>> len(list(tensors_in((t * 1, Cache(t * 2))))), len(list(tensors_in((t * 1, Cache(t * 2)), objects=True)))
    (1, 2)
    """
    return _walk(output, set(), objects)


def _walk(value: Any, seen: set[int], objects: bool) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    for leaf in leaves:
        if torch.is_tensor(leaf):
            if leaf.requires_grad:
                yield leaf
        elif not _opaque(leaf) and id(leaf) not in seen and (objects or dataclasses.is_dataclass(leaf)):
            seen.add(id(leaf))
            for field in _fields_of(leaf):
                yield from _walk(field, seen, objects)


def _opaque(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, type, nn.Module,
                                                torch.dtype, torch.device, torch.Size)) or callable(value)


def _fields_of(value: Any) -> list[Any]:
    """The values an object holds: a dataclass's fields, else its ``__dict__`` and ``__slots__``."""
    if dataclasses.is_dataclass(value):
        return [getattr(value, field.name, None) for field in dataclasses.fields(value)]
    held = list(getattr(value, "__dict__", {}).values())
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        held += [getattr(value, slot, None) for slot in ([slots] if isinstance(slots, str) else slots)
                 if slot not in ("__dict__", "__weakref__")]
    return held
