"""What an engine reports about itself: bytes a step sends, and memory held per category.

:class:`StageReports` asks the stage's collaborators for the parts that differ:
the gradient path (gradients.py: which collective, how often, what it keeps),
the publication (publication.py: what updated parameters cost to send) and the
layout (whole buckets or slices, for the parameters' bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol

import torch

from ..activations.blocks import BlockActivations
from ..distributed.compression.collectives import CompressedCollectives
from ..distributed.hybrid import GroupBytes, HybridCommunicator
from ..distributed.traffic import group_by_dtype, ring_bytes
from ..flat.bucket import Buckets
from ..flat.storage import StoragePlan, Tier
from ..memory import LiveBytes, MemoryReport, nbytes
from ..offload.disk_params import DiskParams
from ..offload.disk_tier import DiskTier
from ..optim.rebuild import optimizer_state_bytes
from ..step import agreement as step_sync
from .params import ParamIndex
from .publication import Publication


class GradientPath(Protocol):
    """What the reports ask of the stage's gradient path (gradients.py)."""

    collective: str

    def reductions_per_step(self, micro_steps: int) -> int: ...

    def held_bytes(self) -> int: ...


class ParamHolder(Protocol):
    """What the reports ask of the stage's layout (buckets.py / unit_scheduler.py)."""

    def param_bytes(self) -> int: ...


@dataclass(frozen=True)
class ReportSources:
    """What the reports read. The callables are read at each report: the plan grows
    (replan.py), the optimizer is wrapped and compression made after the reports."""

    comm: HybridCommunicator
    storage: StoragePlan                   # which tier holds what (flat/storage.py)
    grads: GradientPath
    layout: ParamHolder
    publication: Publication
    params: ParamIndex                     # which parameters train (the agreement's length)
    live: LiveBytes                        # transient communication buffers
    activations: BlockActivations
    disk: Optional[DiskTier]               # the optimizer's files (offload/disk_tier.py)
    disk_params: Optional[DiskParams]      # stage 3's frozen shards in files
    broadcast_buffers: bool
    buffers: Callable[[], list[torch.Tensor]]  # the module's buffers as they are now
    buckets: Buckets
    optimizer: Callable[[], Optional[torch.optim.Optimizer]]
    compression: Callable[[], Optional[CompressedCollectives]]


class StageReports:
    """Bytes per step by the ring model, and the memory report (see model.py)."""

    def __init__(self, sources: ReportSources):
        self.sources = sources

    def ring_model_bytes(self, micro_steps: int) -> GroupBytes:
        """Bytes sent per optimizer step, by group (see :meth:`ShardedModel.ring_model_bytes`)."""
        grads = self.sources.grads
        return (grads.reductions_per_step(micro_steps) * self._gradient_bytes(grads.collective)
                + self.sources.publication.bytes_per_step(micro_steps) + self.control_bytes(micro_steps))

    def control_bytes(self, micro_steps: int) -> GroupBytes:
        """The step's agreement all-reduce, and the buffer broadcast after each backward."""
        sources = self.sources
        world = sources.comm.world_size
        sync = ring_bytes("all_reduce", step_sync.vector_bytes(len(sources.params.trainable)), world)
        buffers = 0
        if sources.broadcast_buffers:
            buffers = sum(ring_bytes("broadcast", sum(nbytes(t) for t in same), world)
                          for same in group_by_dtype(sources.buffers()))
        return GroupBytes(all_ranks=sync + micro_steps * buffers)

    def _gradient_bytes(self, collective: str) -> GroupBytes:
        """What one ``collective`` over every trainable bucket's full gradient sends."""
        trained = [b for b in self.sources.buckets() if b.requires_grad]
        compression = self.sources.compression()
        if compression is not None and compression.grads is not None:
            return compression.gradient_bytes(trained)
        return sum((self.sources.comm.bytes_sent(collective, b.grad_nbytes) for b in trained), GroupBytes())

    def memory_report(self) -> MemoryReport:
        sources = self.sources
        user_optimizer, compression = sources.optimizer(), sources.compression()
        masters = sum(nbytes(b.master) for b in sources.buckets() if b.master_is_separate)
        optimizer = (optimizer_state_bytes(user_optimizer) if user_optimizer is not None else 0) + masters
        master_params = self._masters_as_params()
        files = sources.disk.disk_bytes() if sources.disk is not None else 0  # masters' files included
        frozen_files = sources.disk_params.disk_bytes() if sources.disk_params is not None else 0
        moved = self._moved_bytes()
        rest = sources.storage.of(offloaded=False)  # the tiers of everything not in an offloaded unit
        on_device, on_host = _with_moved(rest.split_by_tier(
            rest.optimizer, optimizer - files - master_params.host - moved[2]), moved[2])
        params, host_params = _with_moved(rest.split_by_tier(
            rest.params, sources.layout.param_bytes() - frozen_files - moved[0]), moved[0] + master_params.host)
        grads, host_grads = _with_moved(rest.split_by_tier(rest.grads, sources.grads.held_bytes() - moved[1]),
                                        moved[1])
        return MemoryReport(
            params=params, grads=grads + (compression.state_bytes() if compression else 0),
            optimizer_states=on_device,
            comm_buffers=sources.live.current, peak_comm_buffers=sources.live.peak,
            host_optimizer_states=on_host, disk_optimizer_states=files - master_params.disk,
            host_params=host_params, host_grads=host_grads, disk_params=frozen_files + master_params.disk,
            **sources.activations.bytes(reset_peaks=True))

    def _masters_as_params(self) -> "MasterParams":
        """The fp32 master bytes that are their bucket's only parameter shard, by tier.

        [Note: an offloaded master is a parameter]
        With ``offload_params`` (stage 3) a trained bucket keeps no compute-dtype shard
        beside its fp32 master (flat/storage.py): the master *is* the parameter shard
        it gathers from, as the resident fp32 run's shard is. ``memory_report()`` so
        counts it in ``host_params`` (``disk_params`` with ``offload_params="disk"``)
        and leaves ``host_optimizer_states`` (``disk_optimizer_states``) the
        optimizer's own state, as DeepSpeed's offload reports parameters apart from
        its moments. A fraction or a budget does so for the offloaded units alone."""
        storage = self.sources.storage
        if storage.params is Tier.DEVICE:
            return MasterParams(0, 0)
        stepped = [b for b in self.sources.buckets() if b.master_is_separate and b.master is not None
                   and (storage.resident is None or b.param_home is not None)]
        if storage.params is Tier.DISK:
            return MasterParams(host=0, disk=self.sources.disk.master_bytes(stepped))
        return MasterParams(host=sum(nbytes(b.master) for b in stepped), disk=0)

    def _moved_bytes(self) -> tuple[int, int, int]:
        """Parameter, gradient and optimizer (master and state) bytes of the buckets of offloaded
        units (``param_home`` set: stage 3 with ``offload_params``), all of them on the host."""
        if self.sources.storage.resident is None:  # one plan for every bucket (all, or none, off the
            return 0, 0, 0                         # device): split_by_tier places each kind, disk included
        moved = [b for b in self.sources.buckets() if b.param_home is not None]
        pieces = {id(piece.param) for b in moved for piece in b.master_pieces}
        optimizer = self.sources.optimizer()
        state = optimizer_state_bytes(optimizer, pieces) if optimizer is not None else 0
        return (sum(nbytes(b.kept_shard) for b in moved if b.kept_shard is not None),
                sum(nbytes(b.grad_shard) for b in moved),
                state)  # their masters: _masters_as_params


class MasterParams(NamedTuple):
    """Master bytes reported as parameters (see [Note: an offloaded master is a parameter])."""

    host: int
    disk: int


def _with_moved(split: tuple[int, int], moved: int) -> tuple[int, int]:
    """``(device, host)`` bytes with ``moved`` host bytes added."""
    return split[0], split[1] + moved
