"""How updated parameters reach every rank after the optimizer step: one class per way.

===================  =====  ========================================================
``KeepReplicas``     0      nothing: every rank stepped every parameter
``GatherAfterStep``  1, 2   the stepped slices are all-gathered into the full buckets
``GatherOnUse``      3      nothing now: the next forward gathers each unit (units.py)
===================  =====  ========================================================

Each also says what its publishing sends per optimizer step (``bytes_per_step``),
the parameter side of ``ring_model_bytes``. A storage tier for parameters
(offloaded between uses, see flat/storage.py) plugs in where stage 3 gathers
and frees a unit (``UnitScheduler.gather_bucket`` / ``free``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..distributed.hybrid import GroupBytes
from ..flat.bucket import FlatBucket

if TYPE_CHECKING:
    from .engine import StageEngine


def gather_bytes(engine: "StageEngine", buckets: list[FlatBucket]) -> GroupBytes:
    """What all-gathering these buckets' full parameters sends."""
    return sum((engine.comm.bytes_sent("all_gather", b.param_nbytes) for b in buckets), GroupBytes())


class KeepReplicas:
    """Stage 0: replicas stepped alike; nothing to send."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine

    def after_step(self, stepped: list[FlatBucket]) -> None:
        pass

    def bytes_per_step(self, micro_steps: int) -> GroupBytes:
        return GroupBytes()


class GatherAfterStep:
    """Stages 1-2: each rank stepped its owned slices; all-gather them into the full buckets."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine

    def after_step(self, stepped: list[FlatBucket]) -> None:
        comm = self.engine.comm
        works = [comm.all_gather(b.full_param, b.fill_own_chunk(), async_op=True) for b in stepped]
        for work in works:
            work.wait()

    def bytes_per_step(self, micro_steps: int) -> GroupBytes:
        return gather_bytes(self.engine, self.engine.stepped_buckets())


class GatherOnUse:
    """Stage 3: slices stay slices; every forward (and backward) gathers the units it runs."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine

    def after_step(self, stepped: list[FlatBucket]) -> None:
        pass  # the next forward gathers the updated slices

    def bytes_per_step(self, micro_steps: int) -> GroupBytes:
        engine = self.engine
        gathers = 2 if engine.config.reshard_after_forward else 1  # forward, and again for backward
        if engine.compression is not None and engine.compression.params is not None:
            per_gather = engine.compression.gather_bytes(engine.buckets)
        else:
            per_gather = gather_bytes(engine, engine.buckets)
        return micro_steps * gathers * per_gather
