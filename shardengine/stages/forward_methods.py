"""``se.model.register_forward_method``: a module entered through a method other than ``forward``.

[Note: registered forward methods]
The engine's hooks run where torch runs hooks: around ``module(...)``, that is
``forward``. A parent that calls ``self.vit.forward_features(x)`` enters a stage-3
unit without them: its parameters are then gathered on their first use and held
to the end of backward (stages/external.py), not gathered ahead and freed after
the call. ``register_forward_method(module, "forward_features")`` (FSDP2's
``register_fsdp_forward_method``) makes that method run the engine's forward
pre-hooks and forward hooks of ``module`` around it, exactly as a call of the
module would, so the unit is prefetched, gathered, freed and re-gathered for
backward as if ``forward`` had been called. The method should not call the
module itself (its hooks would free the unit inside the method).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Protocol

from torch import nn

from ..errors import ConfigError



class HookedEngine(Protocol):
    """What a registered method needs of the engine: its model and the ids of its module hooks."""

    module: nn.Module
    hook_ids: set[int]

_ENGINE_OF: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def note_modules(engine: HookedEngine) -> None:
    """At ``shard()``: every module of the wrapped model knows its engine (weakly)."""
    for module in engine.module.modules():
        _ENGINE_OF[module] = weakref.ref(engine)


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the engine's forward hooks of ``module`` around ``module.<method_name>(...)`` (see the
    Note); at stages 0-2, where nothing is gathered, the method runs as it was.

    >>> import torch, shardengine as se
    >>> class Backbone(torch.nn.Linear):
    ...     def forward_features(self, x):
    ...         return torch.tanh(super().forward(x))
    >>> net = torch.nn.Sequential(Backbone(2, 2))
    >>> model, opt = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
    >>> se.model.register_forward_method(net[0], "forward_features")
    >>> net[0].forward_features(torch.ones(1, 2)).shape
    torch.Size([1, 2])
    """
    reference = _ENGINE_OF.get(module)
    if reference is None or reference() is None:
        raise ConfigError(f"register_forward_method: {type(module).__name__} is not a module of a model "
                          "wrapped by shard(); call it after shard(), on a submodule of that model")
    method = getattr(module, method_name, None)
    if not callable(method) or getattr(method, "__self__", None) is not module:
        raise ConfigError(f"register_forward_method: {type(module).__name__}.{method_name} is not a method "
                          "of that module")

    @functools.wraps(method)
    def with_hooks(*args: Any, **kwargs: Any) -> Any:
        engine = reference()
        if engine is None:
            return method(*args, **kwargs)
        ids = engine.hook_ids
        args, kwargs = _pre_hooks(module, ids, args, kwargs)
        output = method(*args, **kwargs)
        return _post_hooks(module, ids, args, kwargs, output)

    setattr(module, method_name, with_hooks)  # an instance attribute: this module only


def _pre_hooks(module: nn.Module, ids: set[int], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id not in ids:
            continue
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _post_hooks(module: nn.Module, ids: set[int], args: tuple, kwargs: dict, output: Any) -> Any:
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id not in ids:
            continue
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output
