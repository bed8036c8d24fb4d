"""The root module's forward hooks: announce, cast inputs, hook the outputs for backward.

:class:`ForwardHooks` is the engine's collaborator for the root's forward; the
only stage difference it reads is ``spec.forward_communicates`` (stage 3 gathers
units even without grad, so its evaluation forwards are announced under
``model.join()`` too). Stage 3's per-unit hooks live in units.py.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Optional

import torch

from ..errors import ConfigError
from ..flat.units import in_backward, tensors_in
from ..step import join
from ..step.agreement import Announcement
from ..step.batch_weights import ForwardWeight
from ..step.mixed_precision import cast_floats, outputs_to_scale
from . import replan
from .devices import device_of

if TYPE_CHECKING:
    from .engine import StageEngine


class ForwardHooks:
    """Root pre- and post-forward hooks, and the output hooks that start backward."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine
        self.records: list[Optional[ForwardWeight]] = []  # per root forward in progress

    def forget_records(self) -> None:
        """A forward raised (failure.py): no root forward is in progress any more."""
        self.records = []

    def root_pre_forward(self, module, args, kwargs):
        engine = self.engine
        if module is not engine.module:
            return None  # a copy of the module (deepcopy keeps hooks): not ours
        engine.failure.check_usable()
        communicates, training = engine.spec.forward_communicates, torch.is_grad_enabled()
        if communicates and not in_backward():
            engine.calls.check(engine, "a forward pass")
        if engine.step_state.forward_depth and not in_backward():
            engine.failure.fail(f"a forward pass on rank {engine.comm.rank} raised before finishing")
        self._check_params_still_ours()
        if training and not in_backward() and replan.needs_replan(engine) and replan.window_is_empty(engine):
            replan.replan(engine)  # the trainable set grew since shard() (stages/replan.py)
        if not in_backward() and (training or communicates):
            join.announce(engine, Announcement.FORWARD, flag=training, template=(args, kwargs))
        record = None
        if training and not in_backward():
            join.note_inputs(engine, args, kwargs)
            engine.counters.forwards += 1
            record = engine.weights.record_forward(args, kwargs)
            if engine.weights.needs_reference:
                self.agree_first_reference(record)
        self.records.append(record)
        engine.step_state.forward_depth += 1
        if engine.config.param_dtype is not None:
            dtype = engine.config.param_dtype
            return cast_floats(args, dtype), cast_floats(kwargs, dtype)
        return None

    def sync_device(self) -> torch.device:
        """Where the engine's small control collectives live (the model's device)."""
        return device_of(self.engine.module, allow_meta=True)

    def agree_first_reference(self, record: Optional[ForwardWeight] = None) -> None:
        # Once per engine, at the first training forward, which every rank runs (a rank with
        # no data at all joins through model.join(), which takes part here too).
        engine = self.engine
        numerator = torch.tensor([engine.weights.coming_numerator(record)], dtype=torch.float64,
                                 device=self.sync_device())
        if engine.comm.world_size > 1:
            engine.comm.all_reduce(numerator, label="batch_weights").wait()
        engine.weights.set_first_reference(float(numerator) / engine.comm.world_size)

    def holding_gathered(self, budget: int) -> "contextlib.AbstractContextManager[None]":
        """Stage 3: units gathered by forwards without grad stay gathered inside, within ``budget`` bytes.

        [Note: generation at stage 3]
        ``generate()`` runs one forward per new token, and each forward gathers every unit
        and frees it after use: a model of S bytes moves S per token. Holding the units
        gathered for the whole call moves S once, at the price of the gathered model's
        memory (FSDP2 users get the same by ``unshard()``-ing before decoding). The budget
        says how much of that price the user pays: units are held in the order the first
        forward meets them while they fit; the rest are gathered per use as before
        (stages/units.py). Stages 0-2 hold the full parameters anyway: nothing to do.
        """
        holding = getattr(self.engine.layout, "holding", None)
        return holding(budget) if holding is not None else contextlib.nullcontext()

    def root_post_forward(self, module, args, output):
        if module is not self.engine.module:
            return output
        self.engine.step_state.forward_depth -= 1
        record = self.records.pop() if self.records else None
        if torch.is_grad_enabled():
            self.hook_outputs(output, record)
        return output

    def hook_outputs(self, output, record: Optional[ForwardWeight] = None) -> None:
        # Starts the backward bookkeeping (and the final flush) even if no parameter
        # gets a gradient, gives the backward the weight of the forward that made these
        # outputs (step/batch_weights.py), and applies the fp16 loss scale (see step/mixed_precision.py).
        engine = self.engine
        tensors = list(tensors_in(output))
        join.note_outputs(engine, tensors)
        scaled = outputs_to_scale(tensors) if engine.scaler is not None else []
        for tensor in tensors:
            hook = self._scaling_hook if id(tensor) in scaled else self._on_output_grad
            tensor.register_hook(functools.partial(hook, record))

    def _on_output_grad(self, record: Optional[ForwardWeight], grad: torch.Tensor) -> None:
        self.engine.backward.begin_backward()
        self.engine.backward.fix_weight(record)

    def _scaling_hook(self, record: Optional[ForwardWeight], grad: torch.Tensor) -> torch.Tensor:
        self.engine.backward.begin_backward()
        self.engine.backward.fix_weight(record)
        return grad * self.engine.scaler.scale

    def _check_params_still_ours(self) -> None:
        """Catch ``model.module.to(dtype)`` / ``.half()`` and the like after ``shard()``."""
        engine = self.engine
        if engine.step_state.summoned:
            raise RuntimeError("forward inside summon_full_params() is not supported: the "
                               "parameters hold summoned copies there; leave the context first")
        for bucket, first in engine.params.bucket_firsts:
            if bucket.full_params_live and first.data_ptr() != bucket.first_param_ptr():
                raise ConfigError(
                    f"the model's parameters were cast or moved after shard() ({engine.params.name(first)} "
                    f"is now {first.dtype} on {first.device}, the engine holds {bucket.dtype} on "
                    f"{bucket.full_param.device}). Cast or move the model before shard(); for "
                    "mixed precision pass param_dtype=.")
