"""What an engine reports about itself: bytes a step sends, and memory held per category.

:class:`StageReports` asks the stage's collaborators for the parts that differ:
the gradient path (gradients.py: which collective, how often, what it keeps),
the publication (publication.py: what updated parameters cost to send) and the
layout (whole buckets or slices, for the parameters' bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..distributed.hybrid import GroupBytes
from ..distributed.traffic import group_by_dtype, ring_bytes
from ..flat.storage import Tier
from ..memory import MemoryReport, nbytes
from ..optim.rebuild import optimizer_state_bytes
from ..step import agreement as step_sync

if TYPE_CHECKING:
    from .engine import StageEngine


class StageReports:
    """Bytes per step by the ring model, and the memory report (see model.py)."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine

    def ring_model_bytes(self, micro_steps: int) -> GroupBytes:
        """Bytes sent per optimizer step, by group (see :meth:`ShardedModel.ring_model_bytes`)."""
        engine = self.engine
        grads = engine.grads
        return (grads.reductions_per_step(micro_steps) * self._gradient_bytes(grads.collective)
                + engine.publication.bytes_per_step(micro_steps) + self.control_bytes(micro_steps))

    def control_bytes(self, micro_steps: int) -> GroupBytes:
        """The step's agreement all-reduce, and the buffer broadcast after each backward."""
        engine = self.engine
        sync = ring_bytes("all_reduce", step_sync.vector_bytes(len(engine.params.trainable)), engine.world)
        buffers = 0
        if engine.config.broadcast_buffers:
            buffers = sum(ring_bytes("broadcast", sum(nbytes(t) for t in same), engine.world)
                          for same in group_by_dtype(engine.buffers))
        return GroupBytes(all_ranks=sync + micro_steps * buffers)

    def _gradient_bytes(self, collective: str) -> GroupBytes:
        """What one ``collective`` over every trainable bucket's full gradient sends."""
        engine = self.engine
        trained = [b for b in engine.buckets if b.requires_grad]
        if engine.compression is not None and engine.compression.grads is not None:
            return engine.compression.gradient_bytes(trained)
        return sum((engine.comm.bytes_sent(collective, b.grad_nbytes) for b in trained), GroupBytes())

    def memory_report(self) -> MemoryReport:
        engine = self.engine
        masters = sum(nbytes(b.master) for b in engine.buckets if b.master_is_separate)
        optimizer = (optimizer_state_bytes(engine.optimizer) if engine.optimizer is not None else 0) + masters
        master_params = self._masters_as_params()
        files = engine.disk.disk_bytes() if engine.disk is not None else 0  # masters' files included
        frozen_files = engine.disk_params.disk_bytes() if engine.disk_params is not None else 0
        moved = self._moved_bytes()
        rest = engine.storage.of(offloaded=False)  # the tiers of everything not in an offloaded unit
        on_device, on_host = _with_moved(rest.split_by_tier(
            rest.optimizer, optimizer - files - master_params.host - moved[2]), moved[2])
        params, host_params = _with_moved(rest.split_by_tier(
            rest.params, engine.layout.param_bytes() - frozen_files - moved[0]), moved[0] + master_params.host)
        grads, host_grads = _with_moved(rest.split_by_tier(rest.grads, engine.grads.held_bytes() - moved[1]), moved[1])
        return MemoryReport(
            params=params, grads=grads + (engine.compression.state_bytes() if engine.compression else 0),
            optimizer_states=on_device,
            comm_buffers=engine.live.current, peak_comm_buffers=engine.live.peak,
            host_optimizer_states=on_host, disk_optimizer_states=files - master_params.disk,
            host_params=host_params, host_grads=host_grads, disk_params=frozen_files + master_params.disk,
            **engine.activations.bytes(reset_peaks=True))

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
        engine = self.engine
        storage = engine.storage
        if storage.params is Tier.DEVICE:
            return MasterParams(0, 0)
        stepped = [b for b in engine.buckets if b.master_is_separate and b.master is not None
                   and (storage.resident is None or b.param_home is not None)]
        if storage.params is Tier.DISK:
            return MasterParams(host=0, disk=engine.disk.master_bytes(stepped))
        return MasterParams(host=sum(nbytes(b.master) for b in stepped), disk=0)

    def _moved_bytes(self) -> tuple[int, int, int]:
        """Parameter, gradient and optimizer (master and state) bytes of the buckets of offloaded
        units (``param_home`` set: stage 3 with ``offload_params``), all of them on the host."""
        engine = self.engine
        if engine.storage.resident is None:  # one plan for every bucket (all, or none, off the device):
            return 0, 0, 0                   # split_by_tier places each kind, the disk tier included
        moved = [b for b in engine.buckets if b.param_home is not None]
        pieces = {id(piece.param) for b in moved for piece in b.master_pieces}
        state = optimizer_state_bytes(engine.optimizer, pieces) if engine.optimizer is not None else 0
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
