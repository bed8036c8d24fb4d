"""What a stage reports about itself: bytes a step sends, and memory held per category.

A mixin of :class:`~shardengine.stages.base.DataParallel`; each stage overrides the
pieces that differ (what it reduces and gathers, what it keeps).
"""

from __future__ import annotations

from ..step import agreement as step_sync
from ..distributed.traffic import group_by_dtype, ring_bytes
from ..flat.bucket import FlatBucket
from ..distributed.hybrid import GroupBytes
from ..memory import MemoryReport, nbytes
from ..optim.rebuild import optimizer_state_bytes


class StageReports:
    """Bytes per step by the ring model, and the memory report (see model.py)."""

    def ring_model_bytes(self, micro_steps: int) -> GroupBytes:
        """Bytes sent per optimizer step, by group (see :meth:`ShardedModel.ring_model_bytes`)."""
        return self._gradient_bytes("all_reduce") + self.control_bytes(micro_steps)

    def control_bytes(self, micro_steps: int) -> GroupBytes:
        """The step's agreement all-reduce, and the buffer broadcast after each backward."""
        sync = ring_bytes("all_reduce", step_sync.vector_bytes(len(self._trainable)), self.world)
        buffers = 0
        if self.config.broadcast_buffers:
            buffers = sum(ring_bytes("broadcast", sum(nbytes(t) for t in same), self.world)
                          for same in group_by_dtype(self._buffers))
        return GroupBytes(all_ranks=sync + micro_steps * buffers)

    def _gradient_bytes(self, collective: str) -> GroupBytes:
        """What one ``collective`` over every trainable bucket's full gradient sends."""
        if self._compresses_grads:
            return self.compression.gradient_bytes([b for b in self.buckets if b.requires_grad])
        return sum((self.comm.bytes_sent(collective, b.grad_nbytes) for b in self.buckets if b.requires_grad),
                   GroupBytes())

    def _gather_bytes(self, buckets: list[FlatBucket]) -> GroupBytes:
        """What all-gathering these buckets' full parameters sends."""
        return sum((self.comm.bytes_sent("all_gather", b.param_nbytes) for b in buckets), GroupBytes())

    def memory_report(self) -> MemoryReport:
        masters = sum(nbytes(b.master) for b in self.buckets if b.master_is_separate)
        optimizer = self._optimizer_bytes() + masters
        on_device, on_host = self.storage.split_by_tier(self.storage.optimizer, optimizer)
        return MemoryReport(
            params=self._param_bytes(),
            grads=self._grad_bytes() + (self.compression.state_bytes() if self.compression else 0),
            optimizer_states=on_device,
            comm_buffers=self.live.current, peak_comm_buffers=self.live.peak,
            host_optimizer_states=on_host)

    def _param_bytes(self) -> int:
        bucketed = {id(p) for b in self.buckets for p in b.params}
        loose = sum(nbytes(p) for p in self.module.parameters() if id(p) not in bucketed)
        return loose + sum(nbytes(b.full_param) for b in self.buckets)

    def _grad_bytes(self) -> int:
        return sum(nbytes(b.full_grad) for b in self.buckets)

    def _optimizer_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer) if self.optimizer is not None else 0
