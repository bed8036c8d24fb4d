"""Stage 3's parameter shards in the disk tier's files, read in ahead of each gather.

[Note: parameters on disk]
``Offload(params="disk", path=...)`` puts each unit's parameter shard where
``optimizer="disk"`` puts the optimizer's state: in files of the engine's
``DiskTier`` (file_tensors.py, [Note: the disk tier's files are a cache]). A
trained bucket's only shard at stage 3 is its fp32 master ([Note: no compute
copy beside a master], flat/bucket.py), which the optimizer's tier already keeps
in a file; a frozen bucket's kept shard gets one here. What this adds is *when*
the shards are in memory:

* at a unit's gather only: the scheduler (stages/unit_scheduler.py) asks
  :meth:`DiskParams.read_ahead` for the unit after the ones it prefetches, so the
  tier's worker maps that unit's files in while the current unit computes (in
  forward order, and in backward order for the backward's gathers); the gather
  waits for that read (:meth:`DiskParams.reading`), casts the shard into its chunk
  of the full buffer, and has the worker drop the pages again;
* at the step, bucket by bucket, with the optimizer's state (disk_tier.py).

So between a unit's gathers no byte of its shard is resident: host memory holds
the units in flight (read ahead or being gathered) and the buckets being
stepped. The worker is the optimizer tier's one FIFO thread, so a bucket's
write-behind after the step always lands before its next read. The reduced
gradient shards stay in host memory until the step (``StoragePlan.grads``).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from ..flat.bucket import Buckets, FlatBucket
from .file_tensors import return_freed_memory

if TYPE_CHECKING:
    from .disk_tier import DiskTier


class DiskParams:
    """Moves stage 3's parameter shards into the disk tier's files, and in and out per gather."""

    def __init__(self, tier: "DiskTier", buckets: Buckets):
        """``buckets``: every bucket of the plan as it is now (read at each report)."""
        self.tier, self.buckets = tier, buckets
        self.reads: dict[FlatBucket, Future] = {}  # read ahead, not yet gathered

    def place(self, bucket: FlatBucket) -> None:
        """After ``shard_params``: a frozen bucket's kept shard (made on the host) moves into a
        file (a trained one's master is there already, ``DiskTier.place_master``); the shard is
        then written out and dropped until its first gather."""
        files = self.tier.files
        if bucket.kept_shard is not None and not files.holds(bucket.kept_shard):
            bucket.kept_shard = files.copy_of(bucket.kept_shard)
            return_freed_memory()
        self.tier.submit(files.release, self._shard(bucket))

    def _shard(self, bucket: FlatBucket) -> list[torch.Tensor]:
        """The bucket's parameter shard, where it is in a file: the kept slice, else the master."""
        shard = bucket.kept_shard if bucket.kept_shard is not None else bucket.master
        return [shard] if shard is not None and self.tier.files.holds(shard) else []

    def read_ahead(self, buckets: Iterable[FlatBucket]) -> None:
        """Queue the read of each bucket's shard (skipped where one is queued or it is gathered)."""
        for bucket in buckets:
            if bucket not in self.reads and not bucket.full_params_live:
                self.reads[bucket] = self.tier.submit(self.tier.files.prefetch, self._shard(bucket))

    @contextlib.contextmanager
    def reading(self, bucket: FlatBucket) -> Iterator[None]:
        """Around a gather's use of the shard: wait for its read ahead (if any; else the use
        reads it), then have the worker write back and drop its pages."""
        read = self.reads.pop(bucket, None)
        if read is not None:
            read.result()
        try:
            yield
        finally:
            self.tier.submit(self.tier.files.release, self._shard(bucket))

    def drop_unused_reads(self) -> None:
        """After a backward: shards read ahead for a gather that did not come (the order
        changed) leave memory too."""
        reads, self.reads = self.reads, {}
        for bucket in reads:
            self.tier.submit(self.tier.files.release, self._shard(bucket))

    def disk_bytes(self) -> int:
        """Bytes of the frozen buckets' shards in files (a trained shard is its master, counted
        with the optimizer's files as everywhere)."""
        files = self.tier.files
        return sum(files.nbytes(b.kept_shard) for b in self.buckets() if b.kept_shard is not None)
