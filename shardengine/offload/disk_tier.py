"""The disk tier: fp32 master slices and optimizer state in files, stepped bucket by bucket.

[Note: the disk tier's step]
``Offload(optimizer="disk", path=...)`` keeps what ZeRO-Offload keeps in host
memory -- each bucket's fp32 master slice and the optimizer's state over its
pieces -- in files (file_tensors.py, [Note: the disk tier's files are a cache]).
A torch optimizer's step touches every parameter it holds, so stepped whole it
would map all of the state in at once. The disk tier therefore needs the step
bucket by bucket ([Note: a bounded step], optim/bucketed_step.py), and plugs
into its loop (``OptimizerSteps._step_buckets``, stages/stepping.py) through
``each_bucket``: before a bucket is stepped a worker thread has read it in;
after, its new state goes into files, its master is copied to the compute
parameters, and the worker writes it behind while the next bucket is stepped.
An optimizer the engine cannot step bucket by bucket is refused.

Host memory holds at most ``IN_FLIGHT`` = 3 buckets' master and state at once:
the one written behind, the one stepped, the one read ahead. State the
optimizer creates at its first step (Adam's moments) is made in memory for the
one bucket stepped and moved into files before the next; state that is not shaped
like its parameter (Adam's step count, a scalar) stays in host memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import ConfigError
from ..flat.bucket import Buckets, FlatBucket
from ..optim.whole_tensor import inner_optimizers
from .file_tensors import FileTensors, return_freed_memory

IN_FLIGHT = 3  # buckets whose master and state are mapped in at once: written behind, stepped, read ahead


class DiskTier:
    """One rank's files for the optimizer's state, and the bucket-by-bucket step over them."""

    def __init__(self, directory: str, optimizer: Callable[[], Optional[torch.optim.Optimizer]],
                 stepped_buckets: Buckets):
        """``optimizer``: the engine's wrapped optimizer once there is one (read at each use, it
        is made after the tier); ``stepped_buckets``: the buckets with a master, as the plan is now."""
        self.files = FileTensors(directory)
        self.optimizer, self.stepped_buckets = optimizer, stepped_buckets
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardengine-disk")
        self.pending: list[Future] = []

    # ------------------------------------------------------------------ what lives in files

    def place_master(self, bucket: FlatBucket) -> None:
        """Move the bucket's fp32 master (made in host memory) into a file."""
        if bucket.master is not None and not self.files.holds(bucket.master):
            bucket.master = self.files.copy_of(bucket.master)
            bucket.master_is_separate = True
            return_freed_memory()

    def place_state(self, bucket: FlatBucket) -> None:
        """Move the optimizer's state over the bucket's pieces that is shaped like them into files."""
        state, moved = self.optimizer().state, False
        for piece in bucket.master_pieces:
            values = state.get(piece.param, {})
            for key, value in list(values.items()):
                if _follows_param(value, piece.param) and not self.files.holds(value):
                    values[key], moved = self.files.copy_of(value), True
        if moved:
            del value, values  # the loop's last references to the in-memory copies
            return_freed_memory()

    def _tensors(self, bucket: FlatBucket) -> list[torch.Tensor]:
        """The bucket's tensors that live in files: its master and the state over its pieces."""
        optimizer = self.optimizer()
        state = optimizer.state if optimizer is not None else {}
        held = [bucket.master] if bucket.master is not None and self.files.holds(bucket.master) else []
        for piece in bucket.master_pieces:
            held += [v for v in state.get(piece.param, {}).values()
                     if torch.is_tensor(v) and self.files.holds(v)]
        return held

    def disk_bytes(self) -> int:
        """Bytes of the files: every master slice and the state that follows its parameter."""
        return sum(self.files.nbytes(t) for b in self.stepped_buckets() for t in self._tensors(b))

    def master_bytes(self, buckets: list[FlatBucket]) -> int:
        """Bytes of the files of ``buckets``' master slices (a part of :meth:`disk_bytes`)."""
        return sum(self.files.nbytes(b.master) for b in buckets if b.master is not None and self.files.holds(b.master))

    # ------------------------------------------------------------------ the step

    def attach(self, optimizer: torch.optim.Optimizer, bucketed: list[torch.optim.Optimizer]) -> None:
        """Check that every member steps bucket by bucket (optim/bucketed_step.py), and copy the
        state ``load_state_dict`` brings into files."""
        members = inner_optimizers(optimizer)
        if not all(any(member is b for b in bucketed) for member in members):
            raise ConfigError('offload_optimizer="disk" steps the optimizer one bucket at a time, which '
                              f"shardengine does for torch's own per-parameter and whole-tensor optimizer "
                              f"classes, not {', '.join(type(m).__name__ for m in members)}: use one of "
                              "those (e.g. torch.optim.AdamW), or offload_optimizer=True")
        for member in members:
            member.register_load_state_dict_post_hook(lambda _: self._after_load())

    def each_bucket(self, buckets: list[FlatBucket]) -> Iterator[FlatBucket]:
        """The buckets to step, each read in ahead; once the caller has stepped one, its new state
        goes into files, its master to the compute parameters, and it is written behind."""
        read = self._queue(self.files.prefetch, buckets[0]) if buckets else None
        for index, bucket in enumerate(buckets):
            read.result()  # in (the worker's queue is FIFO: so is the write of bucket index - 2)
            if index + 1 < len(buckets):  # queued after the write of bucket index - 1
                read = self._queue(self.files.prefetch, buckets[index + 1])
            yield bucket
            self.place_state(bucket)  # the first step made its state in memory
            bucket.copy_master_to_params()
            self._queue(self.files.release, bucket)
        self._drain()  # the step ends with every bucket written and none mapped in

    def _queue(self, work: Callable[[torch.Tensor], None], bucket: FlatBucket) -> Future:
        return self.submit(work, self._tensors(bucket))

    def submit(self, work: Callable[[torch.Tensor], None], tensors: list[torch.Tensor]) -> Future:
        """Run ``work`` over ``tensors`` on the worker, after everything queued before (FIFO).
        Finished work is forgotten unless it failed: a failure is re-raised at the next drain."""
        self.pending = [f for f in self.pending if not f.done() or f.exception() is not None]
        self.pending.append(self.worker.submit(lambda: [work(t) for t in tensors]))
        return self.pending[-1]

    def _drain(self) -> None:
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()  # re-raises a failed write here, in the step

    def _after_load(self) -> None:
        """``load_state_dict`` put new state tensors (possibly the caller's own) in memory: copy
        them into files of this tier."""
        for bucket in self.stepped_buckets():
            self.place_state(bucket)
            self._queue(self.files.release, bucket)
        self._drain()


def _follows_param(value: Any, param: torch.Tensor) -> bool:
    """State shaped like its parameter (moments, momentum buffers); scalars stay in memory."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape \
        and value.device.type == "cpu"
