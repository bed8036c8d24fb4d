"""What a :class:`~shardengine.model.ShardedModel` reports about itself: memory, traffic, steps.

A mixin of ``ShardedModel`` (model.py): the model-level view of the engine's own
reports (stages/reports.py) and of the communicator's traffic accounting
(distributed/traffic.py), with the per-step snapshot :class:`StepStats`.
See docs/observability.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .distributed.traffic import CommStats
from .engine_api import Engine
from .memory import MemoryReport


class ModelReports:
    """``memory_report``, ``ring_model_bytes``, ``comm_stats`` and ``step_stats`` of a ShardedModel."""

    engine: Engine
    _stats_mark: CommStats  # step_stats() reports traffic since this snapshot
    _skipped_mark: int      # ... and fp16 steps skipped since this count

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds: params, grads, optimizer states, communication buffers."""
        return self.engine.reports.memory_report()

    def ring_model_bytes(self, micro_steps: int = 1) -> int:
        """Bytes this rank should send per optimizer step: the figure to hold
        :meth:`comm_stats` against.

        The ring model (all-reduce 2(N-1)/N*S, reduce-scatter and all-gather (N-1)/N*S)
        applied to the collectives this engine issues, on its padded buffers, for a
        step of ``micro_steps`` backward passes, all but the last under :meth:`no_sync`.
        Included: the step's small agreement all-reduce (step/agreement.py) and the
        buffer broadcasts; not included: the scalar all-reduce of ``clip_grad_norm_``.
        """
        return self.ring_model_bytes_by_group(micro_steps)["total"]

    def ring_model_bytes_by_group(self, micro_steps: int = 1) -> dict[str, int]:
        """:meth:`ring_model_bytes` split as :meth:`comm_stats`' ``by_group`` (hybrid sharding:
        ``intra_group`` in the shard group, ``inter_group`` across the groups, ``all_ranks``),
        plus ``total``."""
        if micro_steps < 1:
            raise ValueError(f"micro_steps must be >= 1, got {micro_steps}")
        by_group = self.engine.reports.ring_model_bytes(micro_steps)
        return {**by_group.as_dict(), "total": by_group.total}

    def comm_stats(self) -> CommStats:
        """Cumulative bytes sent by this rank per collective kind, and seconds in collectives.

        ``by_group`` splits them by the group they ran over: ``intra_group`` (the k ranks
        sharing a layout: reduce-scatters, all-gathers, the clipping norm), ``inter_group``
        (hybrid sharding: the all-reduce of reduced shards across the N/k groups) and
        ``all_ranks`` (stage 0's gradients, the step's agreement, buffers).
        """
        return self.engine.comm.stats

    def reset_comm_stats(self) -> None:
        self.engine.comm.reset_stats()
        self._stats_mark = CommStats()
        self.engine.live.reset_peak()

    def step_stats(self) -> StepStats:
        """Traffic, time in collectives and peak memory since the previous call.

        ``peak_tracked_bytes`` is what the engine itself held at most (model states
        plus its transient buffers); on CUDA ``peak_device_bytes`` is
        ``torch.cuda.max_memory_allocated`` (activations included). Both peaks restart.
        With fp16, ``loss_scale`` is the current dynamic loss scale and ``skipped_steps``
        the optimizer steps skipped for overflowing gradients since the previous call.
        """
        engine, now = self.engine, self.engine.comm.stats
        since, self._stats_mark = now.since(self._stats_mark), now
        report = engine.reports.memory_report()
        scaler = engine.scaler
        skipped = scaler.skipped_steps - self._skipped_mark if scaler is not None else 0
        self._skipped_mark += skipped
        stats = StepStats(dict(since.bytes_by_kind), since.seconds,
                          report.model_states + report.peak_comm_buffers, _device_peak(engine),
                          scaler.scale if scaler is not None else None, skipped,
                          {name: group.bytes_total for name, group in since.by_group.items()})
        engine.live.reset_peak()
        return stats


@dataclass(frozen=True)
class StepStats:
    """What :meth:`ModelReports.step_stats` measured since its previous call."""

    bytes_by_kind: dict[str, int]
    comm_seconds: float
    peak_tracked_bytes: int
    peak_device_bytes: Optional[int]
    loss_scale: Optional[float] = None  # fp16 only
    skipped_steps: int = 0
    bytes_by_group: dict[str, int] = field(default_factory=dict)  # as CommStats.by_group

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_by_kind.values())


def _device_peak(engine: Engine) -> Optional[int]:
    device = next((b.full_param.device for b in engine.buckets), None)
    if device is None or device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak
