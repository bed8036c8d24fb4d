"""Backward: each parameter's gradient hook, the reductions it hands on, and backward's end.

Every stage hooks the end of each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``) and hands ready items to an
:class:`~shardengine.step.reducer.OrderedReducer`, so communication overlaps the
rest of backward; the last items are flushed when backward ends. What differs
between stages is asked of collaborators, never overridden: how a gradient is
stored (the gradient path: gradients.py), which items are reduced in which order
and how (the layout: a bucket at stages 0-2, a unit at stage 3), and the facts
``normalizes_each_backward``, ``guards_params`` and ``reduces_every_micro_step``
(stages/spec.py), given as data in :class:`BackwardSources`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Protocol, Sequence

import torch
from torch import nn

from ..distributed.hybrid import HybridCommunicator
from ..flat import guard
from ..flat.bucket import Buckets, FlatBucket
from ..step.agreement import Announcement, ProgressCounters
from ..step.batch_weights import BatchWeights, ForwardWeight
from ..step.phase import Phase, StepState
from .failure import FailureHandling
from .params import ParamIndex
from .window import GradientWindow


class GradientStore(Protocol):
    """What backward asks of the stage's gradient path (gradients.py)."""

    def adopts(self, bucket: FlatBucket) -> bool: ...

    def store(self, bucket: FlatBucket, index: int, factor: float) -> None: ...


class ReductionLayout(Protocol):
    """What it asks of the layout (buckets.py at stages 0-2, unit_scheduler.py at stage 3)."""

    def item_of(self, bucket: FlatBucket) -> Hashable: ...

    def after_arrival(self, item: Hashable) -> None: ...

    def reduction_order(self) -> Sequence[Hashable]: ...

    def begin_backward(self) -> None: ...

    def end_backward(self) -> None: ...


class Reducer(Protocol):
    """What it asks of the ordered reductions (step/reducer.py)."""

    def start(self, order: Sequence[Hashable]) -> None: ...

    def arrived(self, item: Hashable, name: str) -> None: ...

    def launch_ready(self, launch_enabled: bool = True) -> None: ...

    def flush(self) -> None: ...


class StepOnLanding(Protocol):
    """What it asks of the step inside backward (in_backward.py)."""

    def check_backward(self) -> None: ...

    def before_first_reduction(self) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class BackwardSources:
    """What the backward hooks use: the stage's facts as data, the step's state, the window,
    and callables for what the engine changes (the plan, ``no_sync()``, the module's buffers)
    or what needs the whole engine (the call agreement, ``model.join()``'s announcements).
    The partners built after the hooks come through ``BackwardHooks.connect``."""

    reduces_every_micro_step: bool     # StageSpec: reduced even under no_sync()
    normalizes_each_backward: bool     # StageSpec: DDP's contract, p.grad is the average after backward
    guards_params: bool                # StageSpec: p.grad is guarded between backwards (flat/guard.py)
    broadcast_buffers: bool            # ShardConfig: rank 0's buffers are sent after each backward
    comm: HybridCommunicator
    step_state: StepState
    counters: ProgressCounters
    weights: BatchWeights
    params: ParamIndex
    failure: FailureHandling
    window: GradientWindow
    buckets: Buckets     # every bucket of the plan, as it is now
    buffers: Callable[[], list[torch.Tensor]]   # the module's buffers, read at each broadcast
    sync_enabled: Callable[[], bool]            # False inside no_sync()
    check_call: Callable[[str], None]           # a communicating call begins (step/call_agreement.py)
    announce: Callable[..., None]               # join.announce: model.join()'s ranks hear of it
    backward_done: Callable[[], None]           # join.backward_done


class BackwardHooks:
    """The gradient hooks, the start and end of backward, and the running micro-step's weight."""

    def __init__(self, sources: BackwardSources):
        self.sources = sources
        self.factor = 1.0           # the running micro-step's batch-weight factor
        self.weight_fixed = False   # the running backward's weight is known (step/batch_weights.py)
        self.gradient_path: GradientStore  # the partners: see ``connect``
        self.layout: ReductionLayout
        self.reducer: Reducer
        self.in_backward: StepOnLanding

    def connect(self, gradient_path: GradientStore, layout: ReductionLayout, reducer: Reducer,
                in_backward: StepOnLanding) -> None:
        """The partners built after the hooks (see [Note: partners wired after construction]
        in window.py)."""
        self.gradient_path, self.layout, self.reducer, self.in_backward = gradient_path, layout, reducer, in_backward

    def launch_enabled(self) -> bool:
        return self.sources.sync_enabled() or self.sources.reduces_every_micro_step

    def on_param_grad(self, param: nn.Parameter) -> None:
        params = self.sources.params
        bucket, index = params.slot_of[id(param)]
        params.used_flags[params.flag_of[id(param)]] = 1
        self.begin_backward()
        self.fix_weight(None)  # no output of a forward was reached first (a loss on parameters)
        with guard.engine_access():
            self.gradient_path.store(bucket, index, self.factor)
        item = self.layout.item_of(bucket)
        self.reducer.arrived(item, params.name(param))
        self.layout.after_arrival(item)
        self.in_backward.before_first_reduction()
        self.reducer.launch_ready(self.launch_enabled())

    def begin_backward(self) -> None:
        sources = self.sources
        if not sources.step_state.in_backward:
            sources.failure.check_usable()
            self.in_backward.check_backward()
            sources.check_call("a backward pass")
            sources.announce(Announcement.BACKWARD, flag=self.launch_enabled(),
                             aux=(float(all(b.window_fresh for b in sources.buckets())), 0.0))
            sources.window.reopen()
            sources.step_state.move(Phase.BACKWARD)
            # autograd adds into p.grad, which after an earlier reducing backward of this
            # window is guarded at stages 1-3 (guard.py): open it for this backward.
            guard.set_grad_sharded(sources.params.trainable, False)
            self.reducer.start(self.layout.reduction_order())
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
            self.layout.begin_backward()

    def fix_weight(self, record: Optional[ForwardWeight]) -> None:
        """The running backward's batch weight: that of the forward whose output it reached
        first (see step/batch_weights.py), fixed before any gradient is accumulated."""
        if self.weight_fixed:
            return
        self.weight_fixed = True
        self.factor = self.sources.weights.begin_backward(record).factor
        for bucket in self.sources.buckets():
            if bucket.requires_grad and self.gradient_path.adopts(bucket):
                bucket.prepare_local_factor(self.factor)

    def end_backward(self) -> None:
        sources = self.sources
        self.fix_weight(None)  # a backward that reached no forward's output and no parameter
        self.weight_fixed = False
        sources.step_state.move(Phase.ACCUMULATED)
        sources.counters.backwards += 1
        reduced = self.launch_enabled()
        self.in_backward.before_first_reduction()  # a backward that reached no parameter
        if reduced:
            self.reducer.flush()
        self.reducer.start([])
        for bucket in sources.buckets():
            bucket.undo_zero_weight()  # a factor-0 micro-step under no_sync leaves nothing behind
        sources.weights.end_backward()
        sources.backward_done()
        if reduced and sources.normalizes_each_backward:
            # DDP's contract: after a synchronizing backward p.grad *is* the average, so the
            # window's agreement (weights, fp16 unscaling, unused parameters) happens now.
            sources.window.finish_gradient_sync()
        self._broadcast_buffers()
        if sources.guards_params and any(not b.window_fresh for b in sources.buckets()):
            guard.set_grad_sharded(sources.params.trainable, True)  # see flat/guard.py: p.grad is partial now
        self.layout.end_backward()
        self.in_backward.finish()

    def _broadcast_buffers(self) -> None:
        """DDP's semantics: every forward starts from rank 0's buffers (BatchNorm statistics).

        Sent when backward ends rather than before the next forward: autograd may still
        hold a buffer for backward (BatchNorm keeps its running statistics), and the
        next forward, or an evaluation on rank 0 alone, then needs no collective.
        """
        if self.sources.broadcast_buffers:
            buffers = self.sources.buffers()
            if buffers:
                self.sources.comm.broadcast_coalesced(buffers, label="buffers")
