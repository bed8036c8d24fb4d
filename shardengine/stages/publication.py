"""How updated parameters reach every rank after the optimizer step: one class per way.

===================  =====  ========================================================
``KeepReplicas``     0      nothing: every rank stepped every parameter
``GatherAfterStep``  1, 2   the stepped slices are all-gathered into the full buckets
``GatherOnUse``      3      nothing now: the next forward gathers each unit (unit_scheduler.py)
===================  =====  ========================================================

Each also says what its publishing sends per optimizer step (``bytes_per_step``),
the parameter side of ``ring_model_bytes``. A storage tier for parameters
(offloaded between uses, see flat/storage.py) plugs in where stage 3 gathers
and frees a unit (``UnitScheduler.gather_bucket`` / ``free``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from ..distributed.compression.collectives import CompressedCollectives
from ..distributed.hybrid import GroupBytes, HybridCommunicator
from ..flat.bucket import Buckets, FlatBucket


@dataclass(frozen=True)
class PublicationSources:
    """What any way of publishing may use; each class's ``wire`` takes the few it needs.

    ``buckets`` and ``compression`` are read at each call: the plan grows when the
    trainable set changes (replan.py) and compression is made after the publication."""

    comm: HybridCommunicator
    buckets: Buckets                                            # every bucket of the plan
    stepped_buckets: Buckets                                    # those with a master
    compression: Callable[[], Optional[CompressedCollectives]]  # None: exact collectives
    reshard_after_forward: bool


class Publication(Protocol):
    """How updated parameters reach every rank (one row of stages/recipes.py)."""

    def after_step(self, stepped: list[FlatBucket]) -> None: ...

    def bytes_per_step(self, micro_steps: int) -> GroupBytes: ...


def gather_bytes(comm: HybridCommunicator, buckets: list[FlatBucket]) -> GroupBytes:
    """What all-gathering these buckets' full parameters sends."""
    return sum((comm.bytes_sent("all_gather", b.param_nbytes) for b in buckets), GroupBytes())


class KeepReplicas:
    """Stage 0: replicas stepped alike; nothing to send."""

    @classmethod
    def wire(cls, sources: PublicationSources) -> "KeepReplicas":
        return cls()

    def after_step(self, stepped: list[FlatBucket]) -> None:
        pass

    def bytes_per_step(self, micro_steps: int) -> GroupBytes:
        return GroupBytes()


class GatherAfterStep:
    """Stages 1-2: each rank stepped its owned slices; all-gather them into the full buckets."""

    def __init__(self, comm: HybridCommunicator, stepped_buckets: Buckets):
        self.comm, self.stepped_buckets = comm, stepped_buckets

    @classmethod
    def wire(cls, sources: PublicationSources) -> "GatherAfterStep":
        return cls(sources.comm, sources.stepped_buckets)

    def after_step(self, stepped: list[FlatBucket]) -> None:
        works = [self.comm.all_gather(b.full_param, b.fill_own_chunk(), async_op=True) for b in stepped]
        for work in works:
            work.wait()

    def bytes_per_step(self, micro_steps: int) -> GroupBytes:
        return gather_bytes(self.comm, self.stepped_buckets())


class GatherOnUse:
    """Stage 3: slices stay slices; every forward (and backward) gathers the units it runs."""

    def __init__(self, comm: HybridCommunicator, buckets: Buckets,
                 compression: Callable[[], Optional[CompressedCollectives]], gathers_per_step: int):
        """``gathers_per_step``: how often each unit is gathered per micro-step (2 when the
        forward frees it again, so backward gathers it once more; else 1)."""
        self.comm, self.buckets, self.compression = comm, buckets, compression
        self.gathers_per_step = gathers_per_step

    @classmethod
    def wire(cls, sources: PublicationSources) -> "GatherOnUse":
        gathers = 2 if sources.reshard_after_forward else 1  # forward, and again for backward
        return cls(sources.comm, sources.buckets, sources.compression, gathers)

    def after_step(self, stepped: list[FlatBucket]) -> None:
        pass  # the next forward gathers the updated slices

    def bytes_per_step(self, micro_steps: int) -> GroupBytes:
        compression, buckets = self.compression(), self.buckets()
        if compression is not None and compression.params is not None:
            per_gather = compression.gather_bytes(buckets)
        else:
            per_gather = gather_bytes(self.comm, buckets)
        return micro_steps * self.gathers_per_step * per_gather
