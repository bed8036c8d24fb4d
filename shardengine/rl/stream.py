"""``model.stream_weights()``: the full weights, a bucket at a time, under a hard memory cap.

[Note: a stream's memory and its overlap]
A stream holds at most one bucket being consumed and the next one arriving, and packs
its buckets so that the two together fit ``bucket_bytes`` (packing.py): the next bucket's
gathers are issued before the current one is handed to the consumer, so they overlap the
consumer's work on it. When a rank asks for the next bucket, the stream first *releases*
the one it handed out: the bucket object forgets its tensors, so a consumer that copied
what it needed (a ``load_state_dict``-style copy, an inference engine's
``load_weights``) holds nothing of it, even through the loop variable that still names
it (and its staged inputs: a merged weight's W and adapters, a quantized weight's codes, kept
until then so that Gloo's worker threads, which drop their reference to a finished
broadcast's tensors a moment after it completes, have let go and the free happens on the
stream's thread, before the next bucket is allocated). A consumer that keeps a bucket's tensors keeps their memory (their values stay
right: nothing is reused or freed under a live tensor); the cap then no longer covers it.
Every rank must run the stream to its end (or leave it at the same bucket: the gathers
already issued are waited for), as every rank runs ``full_state_dict()``; a rank that does not receive iterates
too, over buckets that say ``received=False`` and hold nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from ..engine_api import Engine
from ..errors import ConfigError
from ..memory import nbytes
from ..policies import parse_dtype
from .entries import build_entries
from .packing import OUT, BucketPlan, pack, peak_bound, plan_bucket
from .sources import is_collective
from .transfer import TransferIssuer, split

Receivers = Union[str, int, Sequence[int]]
CALL = "model.stream_weights()"


class WeightBucket:
    """Consecutive tensors of the stream, by name: ``for name, tensor in bucket`` (see the Note).

    ``received``: this rank materialized them (else ``names`` only). ``flat``: the bucket's
    output buffers by dtype (the tensors are views of them), what a remote receiver is sent.
    """

    def __init__(self, plan: BucketPlan, buffers: Optional[dict], kept: Optional[list] = None) -> None:
        self.index = plan.index
        # The staged inputs and sent casts: freed with the bucket, not at once, so that Gloo's worker
        # threads have let go of them by then and the free happens here (see [Note: a stream's memory ...]).
        self._kept = kept or []
        self.held_bytes = plan.held_bytes
        self.names = plan.names
        self.received = buffers is not None
        self.nbytes = plan.out_bytes
        self.layout = bucket_layout(plan)
        self.flat: dict[torch.dtype, torch.Tensor] = (
            {dtype: t for (kind, dtype), t in buffers.items() if kind == OUT} if buffers is not None else {})
        self._items = [(name, self.flat[dtype][offset:offset + math.prod(shape)].view(shape))
                       for name, dtype, offset, shape in self.layout] if buffers is not None else []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.received and self.names:
            return iter(())
        if self._items is None:
            raise ConfigError(f"bucket {self.index} of the weight stream was released when the next one was "
                              "requested; copy what you need from a bucket before asking for the next")
        return iter(list(self._items))

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self)

    def __len__(self) -> int:
        return len(self.names)

    def release(self) -> None:
        """Forget the tensors (the stream calls this when the next bucket is requested)."""
        self._items, self.flat, self._kept = None, {}, []

    def __repr__(self) -> str:
        return f"WeightBucket(index={self.index}, tensors={len(self.names)}, bytes={self.nbytes}, received={self.received})"


@dataclass
class StreamStats:
    """What one pass of a stream did on this rank."""

    buckets: int = 0
    bytes: int = 0           # bytes of the streamed tensors (what a receiver gets)
    seconds: float = 0.0     # from the first gather to the last bucket handed out
    wait_seconds: float = 0.0  # of which waiting for gathers (not overlapped with the consumer)


class WeightStream:
    """The full weights of a sharded model, bucket by bucket (``model.stream_weights(...)``).

    Iterate it on every rank (collective when the model is sharded). Attributes:
    ``cap`` (``bucket_bytes``), ``bound_bytes`` (the most a receiving rank holds at once:
    the cap, or a single entry larger than it), ``names``, ``receives`` (whether this rank
    materializes), ``stats`` (of the last pass).
    """

    def __init__(self, engine: Engine, *, dtype=None, bucket_bytes: int = 256 << 20, receivers: Receivers = "all",
                 overlap: bool = True, merge_adapters: bool = True, buffers: bool = True,
                 tied_once: bool = False) -> None:
        engine.failure.check_usable()
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes must be an int >= 1 (bytes a rank may hold for the stream), got "
                              f"{bucket_bytes!r}")
        self.engine, self.cap, self.overlap = engine, bucket_bytes, bool(overlap)
        self.dtype = parse_dtype(dtype, "dtype") if dtype is not None else None
        self.device = _stream_device(engine)
        entries = build_entries(engine, self.dtype, merge_adapters, buffers, tied_once)
        limit = bucket_bytes // 2 if self.overlap else bucket_bytes
        self.plans = [plan_bucket(i, group) for i, group in enumerate(pack(entries, max(limit, 1)))]
        self.bound_bytes = peak_bound(self.plans, bucket_bytes)
        self.names = [name for plan in self.plans for name in plan.names]
        self.collective = any(is_collective(i.source, i.dtype) for p in self.plans for e in p.entries for i in e.inputs)
        group_receivers = _group_receivers(engine, receivers)
        self.issuer = TransferIssuer(engine.comm.shard, group_receivers, self.device)
        self.receives = self.issuer.receives
        self.stats = StreamStats()
        self._steps_at_start: Optional[int] = None

    @property
    def nbytes(self) -> int:
        """Bytes of every streamed tensor (a receiver's whole model in the stream's dtypes)."""
        return sum(plan.out_bytes for plan in self.plans)

    def __iter__(self) -> Iterator[WeightBucket]:
        return self._run()

    def _run(self) -> Iterator[WeightBucket]:
        engine = self.engine
        if self.collective:
            engine.calls.announce(engine, CALL)
        self._steps_at_start = engine.counters.steps
        self.stats = StreamStats()
        started = time.perf_counter()
        pending = self._issue(0) if self.plans else None
        try:
            for index, plan in enumerate(self.plans):
                bucket = self._arrive(plan, pending)
                after = self.plans[index + 1] if index + 1 < len(self.plans) else None
                pending = None
                if after is not None and self.overlap and bucket.held_bytes + after.cost <= self.cap:
                    pending = self._issue(index + 1)
                self.stats.seconds = time.perf_counter() - started
                try:
                    yield bucket
                finally:
                    bucket.release()
                    del bucket
                self._check_not_stepped()
                if after is not None and pending is None:
                    pending = self._issue(index + 1)
        finally:  # left early (every rank at the same bucket): the gathers already issued still end
            for work in pending[2] if pending is not None else ():
                work.wait()
        self.stats.seconds = time.perf_counter() - started

    def _issue(self, index: int):
        plan = self.plans[index]
        transfers, copies = split(plan)
        buffers = None
        if self.receives:
            buffers = {key: torch.empty(numel, dtype=key[1], device=self.device) for key, numel in plan.sizes.items()}
            with torch.no_grad():
                for copy in copies:
                    buffers[copy.place.key][copy.place.offset:copy.place.offset + copy.place.numel].copy_(
                        copy.values.reshape(-1))
        works, kept = self.issuer.issue(transfers, buffers)
        self.engine.live.add(sum(nbytes(b) for b in (buffers or {}).values()) + sum(nbytes(t) for t in kept))
        return plan, buffers, works, kept

    def _arrive(self, plan: BucketPlan, pending) -> WeightBucket:
        _, buffers, works, kept = pending
        waited = time.perf_counter()
        for work in works:
            work.wait()
        self.stats.wait_seconds += time.perf_counter() - waited
        if buffers is not None:
            with torch.no_grad():
                for entry, output, places in zip(plan.entries, plan.outputs, plan.inputs):
                    out = buffers[output.key][output.offset:output.offset + output.numel]
                    inputs = [buffers[p.key][p.offset:p.offset + p.numel] for p in places]
                    entry.form(inputs, out)
            kept += [buffers.pop(key) for key in [key for key in buffers if key[0] != OUT]]
        self.engine.live.sub(sum(nbytes(t) for t in kept) + sum(nbytes(t) for t in (buffers or {}).values()))
        bucket = WeightBucket(plan, buffers, kept)
        self.stats.buckets += 1
        self.stats.bytes += bucket.nbytes
        return bucket

    def _check_not_stepped(self) -> None:
        if self.engine.counters.steps != self._steps_at_start:
            raise ConfigError("the optimizer stepped while the weights were being streamed: the receiver would "
                              "hold weights from two different steps. Run the stream to its end before "
                              "optimizer.step()")


def bucket_layout(plan: BucketPlan) -> list[tuple[str, torch.dtype, int, tuple[int, ...]]]:
    """``(name, dtype, offset, shape)`` of every tensor of a bucket, in its output buffer of that dtype."""
    return [(name, e.dtype, place.offset, e.shape) for e, place in zip(plan.entries, plan.outputs) for name in e.names]


def _stream_device(engine: Engine) -> torch.device:
    for bucket in engine.buckets:
        return bucket.full_param.device
    for param in engine.module.parameters():
        return param.device
    return torch.device("cpu")


def _group_receivers(engine: Engine, receivers: Receivers) -> Optional[list[int]]:
    """The ranks of this rank's shard group that receive (None: every rank), from global ranks."""
    comm = engine.comm
    if isinstance(receivers, str):
        if receivers != "all":
            raise ConfigError(f"receivers must be 'all', a rank or a list of ranks, got {receivers!r}")
        return None
    wanted = [receivers] if isinstance(receivers, int) and not isinstance(receivers, bool) else receivers
    try:
        ranks = sorted({int(r) for r in wanted if not isinstance(r, bool)})
    except (TypeError, ValueError):
        ranks = []
    if not ranks or len(ranks) != len(set(wanted)) or any(not 0 <= r < comm.world_size for r in ranks):
        raise ConfigError(f"receivers must be 'all', a rank or a list of distinct ranks in [0, {comm.world_size}), "
                          f"got {receivers!r}")
    first = comm.group_index * comm.group_size
    return [r - first for r in ranks if first <= r < first + comm.group_size]
