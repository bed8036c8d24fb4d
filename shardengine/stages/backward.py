"""Backward: each parameter's gradient hook, the reductions it launches, and backward's end.

A mixin of :class:`~shardengine.stages.base.DataParallel`. Every stage hooks the
end of each parameter's gradient accumulation (``register_post_accumulate_grad_hook``)
and hands ready items to an :class:`~shardengine.step.reducer.OrderedReducer`, so
communication overlaps the rest of backward; the last items are flushed when
backward ends. What differs between stages are the small steps below that the
stage files override: how a gradient is stored (``_store_grad``), which items are
reduced in which order (``_reduction_order``, ``_item_of``, ``_expected_grads``),
how one is reduced and where the result is kept (``_launch_reduction``,
``_store_reduced``), and the facts ``normalizes_each_backward`` and ``guards_params``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..distributed.work import Work
from ..flat import guard
from ..flat.bucket import FlatBucket
from ..step import join
from ..step.agreement import Announcement
from ..step.batch_weights import ForwardWeight
from ..step.phase import Phase


class BackwardHooks:
    """The gradient hooks and the stage-0 reduction (all-reduce of whole buckets)."""

    def _on_param_grad(self, param: nn.Parameter) -> None:
        bucket, index = self._slot_of[id(param)]
        self._used_flags[self._flag_of[id(param)]] = 1
        self._begin_backward()
        self._fix_weight(None)  # no output of a forward was reached first (a loss on parameters)
        with guard.engine_access():
            self._store_grad(bucket, index)
        item = self._item_of(bucket)
        self.reducer.arrived(item, self._name_of.get(id(param), "?"))
        self._after_arrival(item)
        self.reducer.launch_ready(self._launch_enabled())

    def _begin_backward(self) -> None:
        if not self.step_state.in_backward:
            self.check_usable()
            self.calls.check(self, "a backward pass")
            join.announce(self, Announcement.BACKWARD, flag=self._launch_enabled(),
                          aux=(float(all(b.window_fresh for b in self.buckets)), 0.0))
            self._reopen_window()
            self.step_state.move(Phase.BACKWARD)
            # autograd adds into p.grad, which after an earlier reducing backward of this
            # window is guarded at stages 1-3 (guard.py): open it for this backward.
            guard.set_grad_sharded(self._trainable, False)
            self.reducer.start(self._reduction_order())
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _fix_weight(self, record: Optional[ForwardWeight]) -> None:
        """The running backward's batch weight: that of the forward whose output it reached
        first (see step/batch_weights.py), fixed before any gradient is accumulated."""
        if self._weight_fixed:
            return
        self._weight_fixed = True
        self._factor = self.weights.begin_backward(record).factor
        for bucket in self.buckets:
            if bucket.requires_grad and self._adopts_grads(bucket):
                bucket.prepare_local_factor(self._factor)

    def _end_backward(self) -> None:
        self._fix_weight(None)  # a backward that reached no forward's output and no parameter
        self._weight_fixed = False
        self.step_state.move(Phase.ACCUMULATED)
        self.counters.backwards += 1
        reduced = self._launch_enabled()
        if reduced:
            self.reducer.flush()
        self.reducer.start([])
        for bucket in self.buckets:
            bucket.undo_zero_weight()  # a factor-0 micro-step under no_sync leaves nothing behind
        self.weights.end_backward()
        join.backward_done(self)
        if reduced and self.normalizes_each_backward:
            # DDP's contract: after a synchronizing backward p.grad *is* the average, so the
            # window's agreement (weights, fp16 unscaling, unused parameters) happens now.
            self.finish_gradient_sync()
        self._broadcast_buffers()
        if self.guards_params and any(not b.window_fresh for b in self.buckets):
            guard.set_grad_sharded(self._trainable, True)  # see flat/guard.py: p.grad is partial now

    def _broadcast_buffers(self) -> None:
        """DDP's semantics: every forward starts from rank 0's buffers (BatchNorm statistics).

        Sent when backward ends rather than before the next forward: autograd may still
        hold a buffer for backward (BatchNorm keeps its running statistics), and the
        next forward, or an evaluation on rank 0 alone, then needs no collective.
        """
        if self.config.broadcast_buffers and self._buffers:
            self.comm.broadcast_coalesced(self._buffers, label="buffers")

    def _launch_enabled(self) -> bool:
        return self.sync_enabled

    def _reduction_order(self) -> list:
        return list(self.buckets)

    def _item_of(self, bucket: FlatBucket):
        return bucket

    def _expected_grads(self, bucket: FlatBucket) -> int:
        return len(bucket.params)

    def _after_arrival(self, item) -> None:
        pass

    def _store_grad(self, bucket: FlatBucket, index: int) -> None:
        if self._adopts_grads(bucket):
            bucket.adopt_grad(index)  # its weight factor is applied before the reduction
        else:
            bucket.absorb_grad(index, self._factor)

    def _adopt_missing(self, bucket: FlatBucket) -> None:
        """Before an adopted bucket's reduction: absent gradients count as zero, and the
        micro-steps' weights are multiplied in (see flat/bucket.py)."""
        if self._adopts_grads(bucket):
            with guard.engine_access():
                bucket.undo_zero_weight()
                for index in range(len(bucket.params)):
                    bucket.adopt_grad(index)
                bucket.apply_local_factor()

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        self._adopt_missing(bucket)
        grad = bucket.full_grad
        work = self.compression.all_reduce(bucket) if self._compresses_grads else \
            self.comm.all_reduce(grad, async_op=True)
        return [work.then(lambda: self._store_reduced(bucket, grad.div_(self.world)))]

    def _store_reduced(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        # In place: the next micro-step's local gradients add onto the average, and the
        # next all-reduce then yields the sum of averages (reduction is linear).
        bucket.grad_shard = reduced
        self._mark_reduced(bucket)
