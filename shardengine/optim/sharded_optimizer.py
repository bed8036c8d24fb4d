"""The optimizer ``shard()`` returns: a plain instance of the user's class, tied to the engine.

What the engine adds, through torch's own optimizer hooks where torch has one:

* the step's pre/post hooks end the gradient window (see stages/window.py);
* ``step(closure)``: the closure runs first, then the engine finishes the
  gradient sync, so the step sees this closure's gradients (torch evaluates
  the closure inside ``step``, after the pre-hooks);
* ``zero_grad(set_to_none=...)`` also ends the engine's gradient window and, with
  ``set_to_none=True`` (torch's default), frees its gradient storage;
* ``add_param_group`` after ``shard()``: the group (with torch's defaults
  filled in) appears at once; its parameters are bucketed and sharded at the next
  training forward (see stages/replan.py);
* ``state_dict()`` / ``load_state_dict()`` at stages >= 1 (see optim/state_dict.py):
  this rank's state, per parameter fragment, tagged with the layout it belongs
  to; loading also accepts a plain torch optimizer's state dict.
"""

from __future__ import annotations

import functools
import types

import torch

from ..errors import ConfigError
from ..flat import guard
from .state_dict import add_layout_tag, from_saved_state, refuse_sharded_state
from ..engine_api import Engine


def attach_optimizer(optimizer: torch.optim.Optimizer, engine: Engine) -> None:
    optimizer.register_step_pre_hook(functools.partial(_before_step, engine))
    engine.stepping.attach_tier_step(optimizer)  # between the engine's hooks (the disk tier's)
    optimizer.register_step_post_hook(lambda *_: engine.stepping.after_step())
    optimizer.zero_grad = _zeroing_the_engine_too(optimizer.zero_grad, engine)
    optimizer.add_param_group = functools.partial(_add_param_group, engine, optimizer.add_param_group)
    if hasattr(optimizer, "refuse_member_steps"):  # an OptimizerList
        optimizer.refuse_member_steps()
        for target in (optimizer, *optimizer.optimizers):
            target.add_param_group = _refuse_group_in_list
    if engine.stepping.rebuilds_optimizer:
        _closing_pieces_on_error(optimizer, engine)
        optimizer.register_state_dict_post_hook(functools.partial(add_layout_tag, engine))
        optimizer.register_load_state_dict_pre_hook(functools.partial(from_saved_state, engine))
    else:
        optimizer.register_load_state_dict_pre_hook(functools.partial(refuse_sharded_state, engine))


def _before_step(engine: Engine, optimizer, args, kwargs):
    # torch passes the step's own arguments: ``args[0]`` is the optimizer itself.
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        engine.stepping.before_step()
        return None

    def closure_then_sync():
        loss = closure()
        engine.stepping.before_step()
        return loss

    return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": closure_then_sync}


def _closing_pieces_on_error(optimizer: torch.optim.Optimizer, engine: Engine) -> None:
    """``optimizer.step`` that, if it raises, leaves the pieces guarded and without gradients
    (torch runs no post-hook then: see [Note: the optimizer's pieces outside the step] in
    flat/guard.py). An attribute of the instance, marked as an LR scheduler marks its own wrapper
    (optim/bucketed_step.py does the same), so schedulers see the step either way."""
    previous = optimizer.step

    def step(self: torch.optim.Optimizer, *args, **kwargs):
        self._opt_called = True  # what an LR scheduler's step wrapper records
        try:
            return previous(*args, **kwargs)
        except BaseException:
            engine.stepping.close_pieces()
            raise

    step._wrapped_by_lr_sched = True
    optimizer.step = types.MethodType(step, optimizer)


def _zeroing_the_engine_too(zero_grad, engine: Engine):
    """``optimizer.zero_grad`` that first ends the engine's window, with the same ``set_to_none``."""
    @functools.wraps(zero_grad)
    def wrapper(*args, **kwargs):
        set_to_none = kwargs.get("set_to_none", args[0] if args else True)
        engine.window.zero_grad(bool(set_to_none), everything=False)  # its own parameters only, as torch
        with guard.engine_access():  # it reads the pieces' guarded .grad (flat/guard.py)
            return zero_grad(*args, **kwargs)
    return wrapper


def _add_param_group(engine: Engine, add_param_group, param_group: dict) -> None:
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    _check_new_params(engine, params)
    if not engine.stepping.rebuilds_optimizer:
        # Stage 0 with the user's optimizer: it steps the module's parameters themselves,
        # whose gradients the engine reduces once they train.
        add_param_group({**param_group, "params": params})
        engine.stepping.add_param_group(params)
        return None
    # The group and its hyperparameters exist at once (schedulers, param_groups edits); its
    # fragments join it when the next training forward plans them (stages/replan.py).
    add_param_group({**param_group, "params": []})
    engine.stepping.add_param_group(params)
    return None


def _check_new_params(engine: Engine, params: list) -> None:
    for param in params:
        if not isinstance(param, torch.Tensor) or not engine.params.contains(param):
            raise ConfigError("add_param_group(): every parameter must be a parameter of the sharded "
                              f"model; got {type(param).__name__} of shape "
                              f"{tuple(getattr(param, 'shape', ()))}")
    grouped = {id(p) for group in engine.original_groups + engine.stepping.pending_groups for p in group}
    repeated = [engine.params.name(p) for p in params if id(p) in grouped]
    if repeated or len({id(p) for p in params}) != len(params):
        raise ValueError(f"some parameters appear in more than one parameter group: {repeated[:5]}")


def _refuse_group_in_list(param_group: dict) -> None:
    # A group added to one member would shift the positions of every later member's groups,
    # which the buckets and the checkpoints of an OptimizerList are keyed by.
    raise ConfigError(
        "add_param_group() after shard() is supported for a single optimizer, not for an "
        "OptimizerList or its members: add every param group before shard(), or shard the "
        "model with one optimizer per parameter set as it should end up.")
