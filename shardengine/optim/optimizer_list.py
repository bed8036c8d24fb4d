"""``OptimizerList``: several optimizers over disjoint parameter sets, stepped as one.

The usual Muon recipe needs two optimizers (Muon for the hidden matrices,
AdamW for embeddings, norms, biases and the head). ``se.shard(model, [muon,
adamw])`` wraps them in one ``OptimizerList``, which is what the engine hooks
and what the training loop calls: one ``step()`` (the gradients are reduced
and agreed on once, then every member steps), one ``zero_grad()``, one
``clip_grad_norm_`` (the model's: a single global norm over all of them), one
``state_dict()``.

Its ``param_groups`` are the members' groups, concatenated (the same dict
objects, so editing a group's ``lr`` edits the member's), and its
``state_dict()`` is what one optimizer holding all those groups would write
(positions numbered across members); ``split_state_dict`` /
``join_state_dicts`` convert to and from one torch state dict per member.
Each member keeps its own LR scheduler (``LambdaLR(opts.optimizers[0], ...)``).

Once ``shard()`` has tied the list to the model, a member stepped on its own
would skip the engine's gradient reduction, so it raises instead (step the list).

>>> import torch, shardengine as se
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
>>> opts = se.optim.OptimizerList([torch.optim.SGD(net[0].parameters(), lr=0.1, momentum=0.9),
...                          torch.optim.AdamW(net[1].parameters(), lr=1e-3)])
>>> len(opts.param_groups), [type(o).__name__ for o in opts]
(2, ['SGD', 'AdamW'])
>>> net(torch.randn(3, 4)).sum().backward(); opts.step(); opts.zero_grad()
>>> [len(sd["state"]) for sd in opts.split_state_dict(opts.state_dict())]
[2, 2]
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..errors import ConfigError


class OptimizerList(torch.optim.Optimizer):
    """Optimizers over disjoint parameters that step, zero, save and load together."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 names: Optional[Mapping[int, str]] = None):
        """``names``: ``id(param) -> name``, to name a parameter held twice in the error."""
        optimizers = list(optimizers)
        if not optimizers:
            raise ConfigError("OptimizerList needs at least one optimizer")
        for index, optimizer in enumerate(optimizers):
            if isinstance(optimizer, OptimizerList) or not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigError(f"OptimizerList item {index} must be a torch.optim.Optimizer, got "
                                  f"{type(optimizer).__name__}")
        _check_disjoint(optimizers, names or {})
        self.optimizers = optimizers
        self.defaults: dict[str, Any] = {}
        self._stepping = False
        # What torch.optim.Optimizer.__init__ sets up, minus its own param groups and state.
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())  # OrderedDict: hook handles keep weak references
        self._patch_step_function()

    # ------------------------------------------------------------------ the members' view

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise ConfigError("OptimizerList.param_groups is its members' groups; edit a group "
                          "(param_groups[i]['lr'] = ...) or a member's param_groups instead")

    @property
    def state(self) -> dict:
        """Every member's state, keyed by parameter (read-only view)."""
        return {param: value for optimizer in self.optimizers for param, value in optimizer.state.items()}

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def __getitem__(self, index: int) -> torch.optim.Optimizer:
        return self.optimizers[index]

    def __repr__(self) -> str:
        return f"OptimizerList({', '.join(type(o).__name__ for o in self.optimizers)})"

    @property
    def class_name(self) -> str:
        """``OptimizerList[Muon, AdamW]``: what checkpoints record and compare."""
        return f"OptimizerList[{', '.join(type(o).__name__ for o in self.optimizers)}]"

    # ------------------------------------------------------------------ stepping

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepping = True
        try:
            for optimizer in self.optimizers:
                optimizer.step()
        finally:
            self._stepping = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigError("OptimizerList.add_param_group(): add the group to one of its optimizers "
                          "(opts.optimizers[i].add_param_group(...)), before shard()")

    def refuse_member_steps(self) -> None:
        """Once the list is tied to an engine: a member's own ``step()`` is an error."""
        for optimizer in self.optimizers:
            optimizer.register_step_pre_hook(self._refuse_direct_step)

    def _refuse_direct_step(self, optimizer, args, kwargs) -> None:
        if not self._stepping:
            raise ConfigError(
                f"{type(optimizer).__name__}.step() called on a member of an OptimizerList: call "
                "step() on the list (the optimizer shard() returned), which reduces the gradients "
                "once and then steps every member")

    # ------------------------------------------------------------------ state dicts

    def state_dict(self) -> dict:
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        state_dict = join_state_dicts([optimizer.state_dict() for optimizer in self.optimizers])
        for hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        """This list's ``state_dict()``, or a list of one torch state dict per member."""
        if isinstance(state_dict, (list, tuple)):
            state_dict = join_state_dicts(list(state_dict))
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        for optimizer, part in zip(self.optimizers, self.split_state_dict(state_dict)):
            optimizer.load_state_dict(part)
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    def split_state_dict(self, state_dict: dict) -> list[dict]:
        """One torch state dict per member from the joined form (positions renumbered)."""
        groups = state_dict.get("param_groups")
        counts = [len(optimizer.param_groups) for optimizer in self.optimizers]
        if not isinstance(groups, list) or len(groups) != sum(counts):
            raise ConfigError(f"the optimizer state dict has {len(groups or [])} param groups, this "
                              f"OptimizerList has {sum(counts)} ({counts} per optimizer)")
        extra = {k: v for k, v in state_dict.items() if k not in ("state", "param_groups", "shardengine")}
        parts, first_group = [], 0
        for count in counts:
            mine = groups[first_group:first_group + count]
            first_group += count
            positions = [pos for group in mine for pos in group["params"]]
            renumber = {pos: new for new, pos in enumerate(positions)}
            parts.append({**extra,
                          "state": {renumber[pos]: value for pos, value in state_dict["state"].items()
                                    if pos in renumber},
                          "param_groups": [{**group, "params": [renumber[p] for p in group["params"]]}
                                           for group in mine]})
        return parts


def join_state_dicts(parts: list[dict]) -> dict:
    """Torch state dicts of several optimizers as one optimizer holding all their groups."""
    state, groups, offset = {}, [], 0
    for part in parts:
        positions = sorted({pos for group in part["param_groups"] for pos in group["params"]})
        renumber = {pos: offset + new for new, pos in enumerate(positions)}
        state.update({renumber[pos]: value for pos, value in part["state"].items()})
        groups += [{**group, "params": [renumber[p] for p in group["params"]]} for group in part["param_groups"]]
        offset += len(positions)
    return {"state": state, "param_groups": groups}


def _check_disjoint(optimizers: list[torch.optim.Optimizer], names: Mapping[int, str]) -> None:
    holder: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                first = holder.setdefault(id(param), index)
                if first != index:
                    what = names.get(id(param), f"of shape {tuple(param.shape)}")
                    raise ConfigError(
                        f"parameter {what} is in optimizer {first} ({type(optimizers[first]).__name__}) "
                        f"and in optimizer {index} ({type(optimizer).__name__}); each parameter must "
                        "belong to exactly one optimizer of the list")
