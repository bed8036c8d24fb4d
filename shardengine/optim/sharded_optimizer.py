"""The optimizer ``shard()`` returns: a plain instance of the user's class, tied to the engine.

What the engine adds, through torch's own optimizer hooks where torch has one:

* the step's pre/post hooks end the gradient window (see stages/base.py);
* ``step(closure)``: the closure runs first, then the engine finishes the
  gradient sync, so the step sees this closure's gradients (torch evaluates
  the closure inside ``step``, after the pre-hooks);
* ``zero_grad()`` also ends the engine's gradient window;
* ``add_param_group`` after ``shard()`` is refused where the new parameters
  would be stepped with unreduced gradients or not at all;
* ``state_dict()`` / ``load_state_dict()`` at stages >= 1 (see optim/state_dict.py):
  this rank's state, per parameter fragment, tagged with the layout it belongs
  to; loading also accepts a plain torch optimizer's state dict.
"""

from __future__ import annotations

import functools

import torch

from ..errors import ConfigError
from .state_dict import add_layout_tag, from_saved_state
from ..engine_api import Engine


def attach_optimizer(optimizer: torch.optim.Optimizer, engine) -> None:
    optimizer.register_step_pre_hook(functools.partial(_before_step, engine))
    optimizer.register_step_post_hook(lambda *_: engine.after_step())
    optimizer.zero_grad = _also_calls(optimizer.zero_grad, engine.zero_grad)
    optimizer.add_param_group = functools.partial(_refuse_new_group, engine, optimizer.add_param_group)
    if engine.rebuilds_optimizer:
        optimizer.register_state_dict_post_hook(functools.partial(add_layout_tag, engine))
        optimizer.register_load_state_dict_pre_hook(functools.partial(from_saved_state, engine))


def _before_step(engine: Engine, optimizer, args, kwargs):
    # torch passes the step's own arguments: ``args[0]`` is the optimizer itself.
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        engine.before_step()
        return None

    def closure_then_sync():
        loss = closure()
        engine.before_step()
        return loss

    return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": closure_then_sync}


def _also_calls(method, first):
    """``method`` that runs ``first()`` before itself (engine bookkeeping on zero_grad)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        first()
        return method(*args, **kwargs)
    return wrapper


def _refuse_new_group(engine: Engine, add_param_group, param_group: dict) -> None:
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    reduced = {id(p) for p in engine.trainable_params}
    if not engine.rebuilds_optimizer and all(id(p) in reduced for p in params):
        return add_param_group(param_group)  # stage 0 steps module parameters with reduced grads
    raise ConfigError(
        "optimizer.add_param_group() after shard(): the engine built its buckets and optimizer "
        "shards from the param groups it was given, so new parameters would never be stepped "
        "(or, at stage 0, be stepped with this rank's unreduced gradient). Add every param group "
        "before shard(); to change hyperparameters later, edit optimizer.param_groups[i].")
