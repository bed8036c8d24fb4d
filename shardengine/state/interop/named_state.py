"""Training state keyed by parameter name, the form FSDP2 / torchtitan / DeepSpeed conversions share.

``{"model": {name: tensor}, "optimizer": {"state": {name: {...}}, "param_groups":
[{..., "params": [names]}]}, ...}`` is what ``get_model_state_dict`` /
``get_optimizer_state_dict`` return under FSDP2 (with full tensors) and what torchtitan
saves with DCP. A sharded run loads it at any world size and stage, and exports it.

[Note: names, not positions]
A plain torch optimizer's ``state_dict`` keys parameters by position; positions are only
meaningful with the exact param groups that produced them, which a checkpoint from
another framework does not share. Names survive: this module maps the name-keyed form to
positions in the param groups given to ``shard()`` and back, so a group order or
membership that differs is a clear error instead of moments loaded into the wrong tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError
from ..full_state import check_state_dict
from ..checkpoint import _engine_of

TRAINING_STATE_KEYS = ("model", "optimizer")


def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Load name-keyed training state into a sharded ``model`` and ``optimizer``; no collective.

    ``state`` is ``{"model": {name: tensor}, "optimizer": {"state": {name: {...}},
    "param_groups": [...]}, ...}`` (FSDP2's / torchtitan's layout with full tensors, or
    :func:`shardengine.interop.deepspeed_training_state`). The model may be sharded at any stage
    and world size. Returns the other entries (``lr_scheduler``, ``step``, ...).

    >>> import torch, shardengine as se
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = se.shard(net, torch.optim.AdamW(net.parameters()), stage=2)
    >>> source = torch.nn.Linear(4, 2)
    >>> state = {"model": source.state_dict(), "optimizer": {"state": {}, "param_groups": [
    ...     {**opt.param_groups[0], "lr": 0.5, "params": ["weight", "bias"]}]}, "step": 7}
    >>> se.interop.load_training_state(model, opt, state)
    {'step': 7}
    >>> opt.param_groups[0]["lr"], torch.equal(model.state_dict()["bias"], source.bias)
    (0.5, True)
    """
    missing = [key for key in TRAINING_STATE_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"training state has no {missing} entries; expected {{'model': {{name: tensor}}, "
                              "'optimizer': {'state': {name: ...}, 'param_groups': [...]}}} (torchtitan's layout)")
    engine = _engine_of(model)
    positional = positional_optimizer_state(engine, state["optimizer"])
    # Every check that can fail before any write: the weights' keys and shapes, the groups' members;
    # then the optimizer (it validates per parameter), and the weights last.
    check_state_dict(engine, state["model"])
    model.load_full_optimizer_state_dict(optimizer, positional)
    model.load_state_dict(state["model"])
    return {key: value for key, value in state.items() if key not in TRAINING_STATE_KEYS}


def positional_optimizer_state(engine: Any, named: dict) -> dict:
    """A name-keyed optimizer state dict keyed by position in the param groups given to ``shard()``."""
    groups = [[engine.params.name(p) for p in group] for group in engine.original_groups]
    if "state" not in named and "param_groups" not in named:
        named = _unflattened(named, groups)
    saved = named.get("param_groups", [])
    if [list(g["params"]) for g in saved] != groups:
        raise CheckpointError(
            "the checkpoint's optimizer param groups hold the parameters "
            f"{[list(g['params']) for g in saved]}, the optimizer given to shard() holds {groups}; "
            "build the optimizer with the same param groups, in the same order, as the run that saved it")
    position = {name: i for i, name in enumerate(n for group in groups for n in group)}
    unknown = sorted(set(named.get("state", {})) - set(position))
    if unknown:
        raise CheckpointError(f"the checkpoint holds optimizer state for {unknown}, which are not "
                              "parameters of the optimizer given to shard()")
    return {"state": {position[name]: dict(value) for name, value in named.get("state", {}).items()},
            "param_groups": [{**group, "params": [position[n] for n in group["params"]]} for group in saved]}


def _unflattened(flat: dict, groups: list[list[str]]) -> dict:
    """``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``'s form (torchtitan saves it):
    ``{"state.<name>.<key>": value, "param_groups.<name>.<hyperparameter>": value}``, nested again.

    Names hold dots, so entries are matched against the optimizer's own parameter names; each
    group's hyperparameters are read from its first parameter (a flattened state dict repeats
    them per parameter)."""
    state: dict[str, dict] = {}
    used: set[str] = set()
    for name in (n for group in groups for n in group):
        entries = _entries_under(flat, f"state.{name}.")
        if entries:
            state[name] = {key[len(f"state.{name}."):]: flat[key] for key in entries}
        used.update(entries)
    param_groups = []
    for group in groups:
        hyper = {}
        for index, name in enumerate(group):
            entries = _entries_under(flat, f"param_groups.{name}.")
            used.update(entries)
            if index == 0:
                hyper = {key[len(f"param_groups.{name}."):]: flat[key] for key in entries}
        param_groups.append({**hyper, "params": list(group)})
    unknown = sorted(set(flat) - used)
    if unknown:
        raise CheckpointError(f"the checkpoint's optimizer holds {unknown[:3]}{'...' if len(unknown) > 3 else ''}, "
                              "which name no parameter of the optimizer given to shard() (a flattened optimizer "
                              "state dict: state.<name>.<key>, param_groups.<name>.<hyperparameter>)")
    return {"state": state, "param_groups": param_groups}


def _entries_under(flat: dict, prefix: str) -> list[str]:
    """The keys ``prefix + <one dot-free name>`` (``state.a.b.exp_avg`` is under ``state.a.b.``, not ``state.a.``)."""
    return [key for key in flat if key.startswith(prefix) and "." not in key[len(prefix):]]


def named_optimizer_state(engine: Any, positional: dict) -> dict:
    """The inverse of :func:`positional_optimizer_state` (a full optimizer state dict, keyed by name)."""
    names = [engine.params.name(p) for group in engine.original_groups for p in group]
    return {"state": {names[pos]: value for pos, value in positional["state"].items()},
            "param_groups": [{**group, "params": [names[pos] for pos in group["params"]]}
                             for group in positional["param_groups"]]}
