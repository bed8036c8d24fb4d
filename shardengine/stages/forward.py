"""The root module's forward hooks: announce, cast inputs, hook the outputs for backward.

A mixin of :class:`~shardengine.stages.base.DataParallel`. The only stage
difference is ``forward_communicates`` (stage 3 gathers units even without grad,
so its evaluation forwards are announced under ``model.join()`` too).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..errors import ConfigError
from ..flat.units import in_backward, tensors_in
from ..step import join
from ..step.agreement import Announcement
from ..step.batch_weights import ForwardWeight
from ..step.mixed_precision import cast_floats, outputs_to_scale
from . import replan
from .devices import device_of


class ForwardHooks:
    """Root pre- and post-forward hooks, and the output hooks that start backward."""

    def _root_pre_forward(self, module, args, kwargs):
        if module is not self.module:
            return None  # a copy of the module (deepcopy keeps hooks): not ours
        self.check_usable()
        if self.forward_communicates and not in_backward():
            self.calls.check(self, "a forward pass")
        if self.step_state.forward_depth and not in_backward():
            self.fail(f"a forward pass on rank {self.comm.rank} raised before finishing")
        self._check_params_still_ours()
        if torch.is_grad_enabled() and not in_backward() and replan.needs_replan(self) \
                and replan.window_is_empty(self):
            replan.replan(self)  # the trainable set grew since shard() (stages/replan.py)
        if not in_backward() and (torch.is_grad_enabled() or self.forward_communicates):
            join.announce(self, Announcement.FORWARD, flag=torch.is_grad_enabled(), template=(args, kwargs))
        record = None
        if torch.is_grad_enabled() and not in_backward():
            join.note_inputs(self, args, kwargs)
            self.counters.forwards += 1
            record = self.weights.record_forward(args, kwargs)
            if self.weights.needs_reference:
                self.agree_first_reference(record)
        self._forward_records.append(record)
        self.step_state.forward_depth += 1
        if self.config.param_dtype is not None:
            dtype = self.config.param_dtype
            return cast_floats(args, dtype), cast_floats(kwargs, dtype)
        return None

    def sync_device(self) -> torch.device:
        """Where the engine's small control collectives live (the model's device)."""
        return device_of(self.module, allow_meta=True)

    def agree_first_reference(self, record: Optional[ForwardWeight] = None) -> None:
        # Once per engine, at the first training forward, which every rank runs (a rank with
        # no data at all joins through model.join(), which takes part here too).
        numerator = torch.tensor([self.weights.coming_numerator(record)], dtype=torch.float64,
                                 device=self.sync_device())
        if self.comm.world_size > 1:
            self.comm.all_reduce(numerator, label="batch_weights").wait()
        self.weights.set_first_reference(float(numerator) / self.comm.world_size)

    def _root_post_forward(self, module, args, output):
        if module is not self.module:
            return output
        self.step_state.forward_depth -= 1
        record = self._forward_records.pop() if self._forward_records else None
        if torch.is_grad_enabled():
            self.hook_outputs(output, record)
        return output

    def hook_outputs(self, output, record: Optional[ForwardWeight] = None) -> None:
        # Starts the backward bookkeeping (and the final flush) even if no parameter
        # gets a gradient, gives the backward the weight of the forward that made these
        # outputs (step/batch_weights.py), and applies the fp16 loss scale (see step/mixed_precision.py).
        tensors = list(tensors_in(output))
        join.note_outputs(self, tensors)
        scaled = outputs_to_scale(tensors) if self.scaler is not None else []
        for tensor in tensors:
            hook = self._scaling_hook if id(tensor) in scaled else self._on_output_grad
            tensor.register_hook(functools.partial(hook, record))

    def _on_output_grad(self, record: Optional[ForwardWeight], grad: torch.Tensor) -> None:
        self._begin_backward()
        self._fix_weight(record)

    def _scaling_hook(self, record: Optional[ForwardWeight], grad: torch.Tensor) -> torch.Tensor:
        self._begin_backward()
        self._fix_weight(record)
        return grad * self.scaler.scale

    def _check_params_still_ours(self) -> None:
        """Catch ``model.module.to(dtype)`` / ``.half()`` and the like after ``shard()``."""
        if self.summoned:
            raise RuntimeError("forward inside summon_full_params() is not supported: the "
                               "parameters hold summoned copies there; leave the context first")
        for bucket, first in self._bucket_ptrs:
            if bucket.full_params_live and first.data_ptr() != bucket.first_param_ptr():
                raise ConfigError(
                    f"the model's parameters were cast or moved after shard() ({self._name_of[id(first)]} "
                    f"is now {first.dtype} on {first.device}, the engine holds {bucket.dtype} on "
                    f"{bucket.full_param.device}). Cast or move the model before shard(); for "
                    "mixed precision pass param_dtype=.")
