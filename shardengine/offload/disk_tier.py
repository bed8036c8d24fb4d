"""The disk tier: fp32 master slices and optimizer state in files, stepped bucket by bucket.

[Note: the disk tier's step]
``Offload(optimizer="disk", path=...)`` keeps what ZeRO-Offload keeps in host
memory -- each bucket's fp32 master slice and the optimizer's state over its
pieces -- in files (file_tensors.py, [Note: the disk tier's files are a cache]).
A torch optimizer's step touches every parameter it holds, so stepped whole it
would map all of the state in at once. Instead the step runs bucket by bucket:
a pre-step hook (after the engine's own, which synced the gradients) takes one
bucket at a time, points its pieces at the bucket's gradient (under mixed
precision an fp32 copy of this bucket's only), runs torch's own step function
with each param group narrowed to the bucket's pieces, drops the gradient,
copies the master to the compute parameters and hands the bucket to a worker
thread, which writes it behind while the next bucket is stepped; the same worker
reads the next bucket ahead. The optimizer's own step then runs over empty
groups, and a post-step hook (before the engine's ``after_step``) gives the
groups their parameters back. Per-parameter optimizers (Adam, SGD, ...) and
whole-tensor ones (Muon) step each parameter from its own state, so narrowing
the groups changes no number.

Host memory holds at most ``IN_FLIGHT`` = 3 buckets' master and state at once:
the one written behind, the one stepped, the one read ahead. State the
optimizer creates at its first step (Adam's moments) is made in memory for the
one bucket stepped and moved into files before the next; state that is not shaped
like its parameter (Adam's step count, a scalar) stays in host memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..errors import ConfigError
from ..flat.bucket import FlatBucket
from .file_tensors import FileTensors, return_freed_memory

if TYPE_CHECKING:
    from ..stages.engine import StageEngine

IN_FLIGHT = 3  # buckets whose master and state are mapped in at once: written behind, stepped, read ahead


class DiskTier:
    """One rank's files for the optimizer's state, and the bucket-by-bucket step over them."""

    def __init__(self, directory: str, engine: "StageEngine"):
        self.files = FileTensors(directory)
        self.engine = engine
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardengine-disk")
        self.pending: list[Future] = []
        self.groups_held: Optional[list[list[torch.Tensor]]] = None  # the groups' params during a step

    # ------------------------------------------------------------------ what lives in files

    def place_master(self, bucket: FlatBucket) -> None:
        """Move the bucket's fp32 master (made in host memory) into a file."""
        if bucket.master is not None and not self.files.holds(bucket.master):
            bucket.master = self.files.copy_of(bucket.master)
            bucket.master_is_separate = True
            return_freed_memory()

    def place_state(self, bucket: FlatBucket) -> None:
        """Move the optimizer's state over the bucket's pieces that is shaped like them into files."""
        state, moved = self.engine.optimizer.state, False
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
        state = self.engine.optimizer.state if self.engine.optimizer is not None else {}
        held = [bucket.master] if bucket.master is not None and self.files.holds(bucket.master) else []
        for piece in bucket.master_pieces:
            held += [v for v in state.get(piece.param, {}).values()
                     if torch.is_tensor(v) and self.files.holds(v)]
        return held

    def disk_bytes(self) -> int:
        """Bytes of the files: every master slice and the state that follows its parameter."""
        return sum(self.files.nbytes(t) for b in self.engine.stepped_buckets() for t in self._tensors(b))

    # ------------------------------------------------------------------ the step

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook the bucket-by-bucket step in; call between the engine's pre- and post-step hooks."""
        if hasattr(optimizer, "refuse_member_steps"):
            raise ConfigError('offload_optimizer="disk" steps one optimizer bucket by bucket; an '
                              "OptimizerList is not supported with it: use one optimizer, or "
                              "offload_optimizer=True")
        optimizer.register_step_pre_hook(self._step_by_bucket)
        optimizer.register_step_post_hook(self._give_groups_back)
        optimizer.register_load_state_dict_post_hook(lambda _: self._after_load())

    def _step_by_bucket(self, optimizer, args: tuple, kwargs: dict):
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # the engine's wrapper: the gradients are synced after it
        engine = self.engine
        if not (engine.scaler is not None and engine.window.found_inf):  # a skipped step changes nothing
            self._step_buckets(optimizer, engine.stepped_buckets())
        self.groups_held = [group["params"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["params"] = []  # the optimizer's own step: already done above
        rest = {k: v for k, v in kwargs.items() if k != "closure"}
        return args[:1], ({**rest, "closure": lambda: loss} if closure is not None else rest)

    def _give_groups_back(self, optimizer, *_: Any) -> None:
        if self.groups_held is not None:
            for group, params in zip(optimizer.param_groups, self.groups_held):
                group["params"] = params
            self.groups_held = None

    def _step_buckets(self, optimizer, buckets: list[FlatBucket]) -> None:
        engine = self.engine
        step = type(optimizer).step.__wrapped__  # torch's step without its hooks (these run once, around us)
        saved = [group["params"] for group in optimizer.param_groups]
        try:
            if buckets:
                self._queue(self.files.prefetch, buckets[0])
            for index, bucket in enumerate(buckets):
                if index + 1 < len(buckets):  # FIFO: the write of bucket index-1 is queued before this read
                    self._queue(self.files.prefetch, buckets[index + 1])
                mine = {id(piece.param) for piece in bucket.master_pieces}
                for group, params in zip(optimizer.param_groups, saved):
                    group["params"] = [p for p in params if id(p) in mine]
                engine.stepping.give_piece_grads(bucket)  # its fp32 gradient exists for this bucket only
                step(optimizer)
                bucket.set_piece_grads(None)
                self.place_state(bucket)  # the first step made its state in memory
                bucket.copy_master_to_params()
                self._queue(self.files.release, bucket)
            self._drain()  # the step ends with every bucket written and none mapped in
        finally:
            for group, params in zip(optimizer.param_groups, saved):
                group["params"] = params

    def _queue(self, work: Callable[[torch.Tensor], None], bucket: FlatBucket) -> None:
        tensors = self._tensors(bucket)
        self.pending.append(self.worker.submit(lambda: [work(t) for t in tensors]))

    def _drain(self) -> None:
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()  # re-raises a failed write here, in the step

    def _after_load(self) -> None:
        """``load_state_dict`` put new state tensors (possibly the caller's own) in memory: copy
        them into files of this tier."""
        for bucket in self.engine.stepped_buckets():
            self.place_state(bucket)
            self._queue(self.files.release, bucket)
        self._drain()


def _follows_param(value: Any, param: torch.Tensor) -> bool:
    """State shaped like its parameter (moments, momentum buffers); scalars stay in memory."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape \
        and value.device.type == "cpu"
