"""``copy.deepcopy`` of a sharded model: a plain module, free of the engine.

``copy.deepcopy(model)`` (an EMA, a frozen reference model) copies Python
objects wholesale, the engine's forward hooks included: the copy would call
into the original's engine, gathering and reducing for the wrong module. The
copy made here drops those hooks and the wrap mark, keeps everything else of
the module, and holds this rank's current parameter values. At stage 3 those
exist only inside ``summon_full_params()``, so copying outside it is an error.
"""

from __future__ import annotations

import copy

from torch import nn

from ..errors import ShardedAccessError
from ..flat.guard import state_of
from ..engine_api import Engine

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def copy_module(engine: Engine, module: nn.Module, memo: dict) -> nn.Module:
    sharded = [name for name, p in module.named_parameters()
               if (state := state_of(p)) is not None and state.sharded]
    if sharded:
        raise ShardedAccessError(
            f"copy.deepcopy of a stage-3 model outside summon_full_params(): this rank holds only "
            f"slices of {len(sharded)} parameter(s) (e.g. {sharded[0]!r}). Copy inside "
            "`with model.summon_full_params(): ema = copy.deepcopy(model)` (every rank), or "
            "build the copy from model.state_dict().")
    copied = copy.deepcopy(module, memo)  # the engine copies as itself (its __deepcopy__)
    ours = engine.hook_ids
    for original, twin in zip(module.modules(), copied.modules()):
        for name in _HOOK_DICTS:
            hooks = getattr(twin, name, None)
            if hooks:
                for hook_id in [k for k in hooks if k in ours and k in getattr(original, name, {})]:
                    del hooks[hook_id]
    return copied
