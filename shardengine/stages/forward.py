"""The root module's forward hooks: announce, cast inputs, hook the outputs for backward.

:class:`ForwardHooks` is the engine's collaborator for the root's forward; the
only stage difference it reads is ``forward_communicates`` (stage 3 gathers
units even without grad, so its evaluation forwards are announced under
``model.join()`` too). Stage 3's per-unit hooks live in units.py.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from ..distributed.hybrid import HybridCommunicator
from ..errors import ConfigError
from ..flat.units import in_backward, tensors_in
from ..step.agreement import Announcement, ProgressCounters
from ..step.batch_weights import BatchWeights, ForwardWeight
from ..step.mixed_precision import DynamicLossScaler, cast_floats, outputs_to_scale
from ..step.phase import StepState
from .devices import device_of
from .params import ParamIndex


class Failure(Protocol):
    """What the forward hooks ask of failure handling (failure.py)."""

    def check_usable(self) -> None: ...

    def fail(self, what: str) -> None: ...


class BackwardStart(Protocol):
    """What the output hooks ask of the backward hooks (backward.py)."""

    def begin_backward(self) -> None: ...

    def fix_weight(self, record: Optional[ForwardWeight]) -> None: ...


@dataclass(frozen=True)
class ForwardSources:
    """What the root's forward hooks use: the stage's fact and the compute dtype as data, the
    step's state, and callables for what needs the whole engine (the call agreement,
    ``model.join()``, growing the plan: replan.py). The partners built after the hooks come
    through ``ForwardHooks.connect``."""

    forward_communicates: bool          # StageSpec: stage 3's forwards gather units
    param_dtype: Optional[torch.dtype]  # ShardConfig: inputs are cast to it (None: left as they are)
    module: nn.Module                   # the root this engine wraps
    comm: HybridCommunicator
    step_state: StepState
    counters: ProgressCounters
    weights: BatchWeights
    params: ParamIndex
    scaler: Optional[DynamicLossScaler]  # fp16 only
    check_call: Callable[[str], None]    # a communicating call begins (step/call_agreement.py)
    announce: Callable[..., None]        # join.announce: model.join()'s ranks hear of it
    note_inputs: Callable[[tuple, dict], None]       # join.note_inputs
    note_outputs: Callable[[list[torch.Tensor]], None]  # join.note_outputs
    replan_if_grown: Callable[[], None]  # replan.replan_if_grown: the trainable set grew since shard()


class ForwardHooks:
    """Root pre- and post-forward hooks, and the output hooks that start backward."""

    def __init__(self, sources: ForwardSources):
        self.sources = sources
        self.records: list[Optional[ForwardWeight]] = []  # per root forward in progress
        self.failure: Failure  # the partners: see ``connect``
        self.backward: BackwardStart
        self.layout: object

    def connect(self, failure: Failure, backward: BackwardStart, layout: object) -> None:
        """The partners built after the hooks (see [Note: partners wired after construction]
        in window.py); ``layout``: stage 3's holds units gathered (``holding``), the others not."""
        self.failure, self.backward, self.layout = failure, backward, layout

    def forget_records(self) -> None:
        """A forward raised (failure.py): no root forward is in progress any more."""
        self.records = []

    def root_pre_forward(self, module, args, kwargs):
        sources = self.sources
        if module is not sources.module:
            return None  # a copy of the module (deepcopy keeps hooks): not ours
        self.failure.check_usable()
        communicates, training = sources.forward_communicates, torch.is_grad_enabled()
        if communicates and not in_backward():
            sources.check_call("a forward pass")
        if sources.step_state.forward_depth and not in_backward():
            self.failure.fail(f"a forward pass on rank {sources.comm.rank} raised before finishing")
        self._check_params_still_ours()
        if training and not in_backward():
            sources.replan_if_grown()  # the trainable set grew since shard() (stages/replan.py)
        if not in_backward() and (training or communicates):
            sources.announce(Announcement.FORWARD, flag=training, template=(args, kwargs))
        record = None
        if training and not in_backward():
            sources.note_inputs(args, kwargs)
            sources.counters.forwards += 1
            record = sources.weights.record_forward(args, kwargs)
            if sources.weights.needs_reference:
                self.agree_first_reference(record)
        self.records.append(record)
        sources.step_state.forward_depth += 1
        if sources.param_dtype is not None:
            dtype = sources.param_dtype
            return cast_floats(args, dtype), cast_floats(kwargs, dtype)
        return None

    def sync_device(self) -> torch.device:
        """Where the engine's small control collectives live (the model's device)."""
        return device_of(self.sources.module, allow_meta=True)

    def agree_first_reference(self, record: Optional[ForwardWeight] = None) -> None:
        # Once per engine, at the first training forward, which every rank runs (a rank with
        # no data at all joins through model.join(), which takes part here too).
        weights, comm = self.sources.weights, self.sources.comm
        numerator = torch.tensor([weights.coming_numerator(record)], dtype=torch.float64,
                                 device=self.sync_device())
        if comm.world_size > 1:
            comm.all_reduce(numerator, label="batch_weights").wait()
        weights.set_first_reference(float(numerator) / comm.world_size)

    def holding_gathered(self, budget: int) -> "contextlib.AbstractContextManager[None]":
        """Stage 3: units gathered by forwards without grad stay gathered inside, within ``budget`` bytes.

        [Note: generation at stage 3]
        ``generate()`` runs one forward per new token, and each forward gathers every unit
        and frees it after use: a model of S bytes moves S per token. Holding the units
        gathered for the whole call moves S once, at the price of the gathered model's
        memory (FSDP2 users get the same by ``unshard()``-ing before decoding). The budget
        says how much of that price the user pays: units are held in the order the first
        forward meets them while they fit; the rest are gathered per use as before
        (stages/unit_scheduler.py). Stages 0-2 hold the full parameters anyway: nothing to do.
        """
        holding = getattr(self.layout, "holding", None)
        return holding(budget) if holding is not None else contextlib.nullcontext()

    def root_post_forward(self, module, args, output):
        if module is not self.sources.module:
            return output
        self.sources.step_state.forward_depth -= 1
        record = self.records.pop() if self.records else None
        if torch.is_grad_enabled():
            self.hook_outputs(output, record)
        return output

    def hook_outputs(self, output, record: Optional[ForwardWeight] = None) -> None:
        # Starts the backward bookkeeping (and the final flush) even if no parameter
        # gets a gradient, gives the backward the weight of the forward that made these
        # outputs (step/batch_weights.py), and applies the fp16 loss scale (see step/mixed_precision.py).
        tensors = list(tensors_in(output))
        self.sources.note_outputs(tensors)
        scaled = outputs_to_scale(tensors) if self.sources.scaler is not None else []
        for tensor in tensors:
            hook = self._scaling_hook if id(tensor) in scaled else self._on_output_grad
            tensor.register_hook(functools.partial(hook, record))

    def _on_output_grad(self, record: Optional[ForwardWeight], grad: torch.Tensor) -> None:
        self.backward.begin_backward()
        self.backward.fix_weight(record)

    def _scaling_hook(self, record: Optional[ForwardWeight], grad: torch.Tensor) -> torch.Tensor:
        self.backward.begin_backward()
        self.backward.fix_weight(record)
        return grad * self.sources.scaler.scale

    def _check_params_still_ours(self) -> None:
        """Catch ``model.module.to(dtype)`` / ``.half()`` and the like after ``shard()``."""
        params = self.sources.params
        if self.sources.step_state.summoned:
            raise RuntimeError("forward inside summon_full_params() is not supported: the "
                               "parameters hold summoned copies there; leave the context first")
        for bucket, first in params.bucket_firsts:
            if bucket.full_params_live and first.data_ptr() != bucket.first_param_ptr():
                raise ConfigError(
                    f"the model's parameters were cast or moved after shard() ({params.name(first)} "
                    f"is now {first.dtype} on {first.device}, the engine holds {bucket.dtype} on "
                    f"{bucket.full_param.device}). Cast or move the model before shard(); for "
                    "mixed precision pass param_dtype=.")
