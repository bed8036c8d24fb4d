"""Backward: each parameter's gradient hook, the reductions it hands on, and backward's end.

Every stage hooks the end of each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``) and hands ready items to an
:class:`~shardengine.step.reducer.OrderedReducer`, so communication overlaps the
rest of backward; the last items are flushed when backward ends. What differs
between stages is asked of collaborators, never overridden: how a gradient is
stored (``engine.grads``: gradients.py), which items are reduced in which order
and how (``engine.layout``: a bucket at stages 0-2, a unit at stage 3), and the
facts ``spec.normalizes_each_backward``, ``spec.guards_params`` and
``spec.reduces_every_micro_step``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from ..flat import guard
from ..step import join
from ..step.agreement import Announcement
from ..step.batch_weights import ForwardWeight
from ..step.phase import Phase

if TYPE_CHECKING:
    from .engine import StageEngine


class BackwardHooks:
    """The gradient hooks, the start and end of backward, and the running micro-step's weight."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine
        self.factor = 1.0           # the running micro-step's batch-weight factor
        self.weight_fixed = False   # the running backward's weight is known (step/batch_weights.py)

    def launch_enabled(self) -> bool:
        engine = self.engine
        return engine.sync_enabled or engine.spec.reduces_every_micro_step

    def on_param_grad(self, param: nn.Parameter) -> None:
        engine = self.engine
        params = engine.params
        bucket, index = params.slot_of[id(param)]
        params.used_flags[params.flag_of[id(param)]] = 1
        self.begin_backward()
        self.fix_weight(None)  # no output of a forward was reached first (a loss on parameters)
        with guard.engine_access():
            engine.grads.store(bucket, index, self.factor)
        item = engine.layout.item_of(bucket)
        engine.reducer.arrived(item, params.name(param))
        engine.layout.after_arrival(item)
        engine.in_backward.before_first_reduction()
        engine.reducer.launch_ready(self.launch_enabled())

    def begin_backward(self) -> None:
        engine = self.engine
        if not engine.step_state.in_backward:
            engine.failure.check_usable()
            engine.in_backward.check_backward()
            engine.calls.check(engine, "a backward pass")
            join.announce(engine, Announcement.BACKWARD, flag=self.launch_enabled(),
                          aux=(float(all(b.window_fresh for b in engine.buckets)), 0.0))
            engine.window.reopen()
            engine.step_state.move(Phase.BACKWARD)
            # autograd adds into p.grad, which after an earlier reducing backward of this
            # window is guarded at stages 1-3 (guard.py): open it for this backward.
            guard.set_grad_sharded(engine.params.trainable, False)
            engine.reducer.start(engine.layout.reduction_order())
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
            engine.layout.begin_backward()

    def fix_weight(self, record: Optional[ForwardWeight]) -> None:
        """The running backward's batch weight: that of the forward whose output it reached
        first (see step/batch_weights.py), fixed before any gradient is accumulated."""
        if self.weight_fixed:
            return
        engine = self.engine
        self.weight_fixed = True
        self.factor = engine.weights.begin_backward(record).factor
        for bucket in engine.buckets:
            if bucket.requires_grad and engine.grads.adopts(bucket):
                bucket.prepare_local_factor(self.factor)

    def end_backward(self) -> None:
        engine = self.engine
        self.fix_weight(None)  # a backward that reached no forward's output and no parameter
        self.weight_fixed = False
        engine.step_state.move(Phase.ACCUMULATED)
        engine.counters.backwards += 1
        reduced = self.launch_enabled()
        engine.in_backward.before_first_reduction()  # a backward that reached no parameter
        if reduced:
            engine.reducer.flush()
        engine.reducer.start([])
        for bucket in engine.buckets:
            bucket.undo_zero_weight()  # a factor-0 micro-step under no_sync leaves nothing behind
        engine.weights.end_backward()
        join.backward_done(engine)
        if reduced and engine.spec.normalizes_each_backward:
            # DDP's contract: after a synchronizing backward p.grad *is* the average, so the
            # window's agreement (weights, fp16 unscaling, unused parameters) happens now.
            engine.window.finish_gradient_sync()
        self._broadcast_buffers()
        if engine.spec.guards_params and any(not b.window_fresh for b in engine.buckets):
            guard.set_grad_sharded(engine.params.trainable, True)  # see flat/guard.py: p.grad is partial now
        engine.layout.end_backward()
        engine.in_backward.finish()

    def _broadcast_buffers(self) -> None:
        """DDP's semantics: every forward starts from rank 0's buffers (BatchNorm statistics).

        Sent when backward ends rather than before the next forward: autograd may still
        hold a buffer for backward (BatchNorm keeps its running statistics), and the
        next forward, or an evaluation on rank 0 alone, then needs no collective.
        """
        engine = self.engine
        if engine.config.broadcast_buffers and engine.buffers:
            engine.comm.broadcast_coalesced(engine.buffers, label="buffers")
