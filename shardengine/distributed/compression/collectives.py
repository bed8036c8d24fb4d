"""The engine's compressed collectives: ``shard(compression=...)`` on real buckets.

The math lives in distributed/compression/codecs.py (int8 blocks, error feedback, bf16/fp16 casts)
and distributed/compression/powersgd.py; this module runs it around the communicator's collectives for
the stage strategies, keeps the per-bucket state that outlives a step (error
feedback residuals, PowerSGD's errors and warm-start Q's), and says what each
option sends, in the counters' own terms, for ``ring_model_bytes``.

[Note: compressed reductions in the engine]
Stages 1-3 reduce-scatter each gradient bucket. Compressed, that is one
all-to-all: rank r sends every other rank the chunk it owns, cast to bf16/fp16
or int8-quantized (each value encoded once, see distributed/compression/codecs.py's qgZ Note),
and sums what it receives plus its own chunk, exact, in fp32. Per rank
(N-1)/N of the buffer at the wire size (int8: plus 4 bytes per block).
Stage 0 all-reduces: the same all-to-all, then an all-gather of each owner's
sum in the same wire format. Every rank, the owner included, takes the
decoded values, so the replicas apply bit-identical gradients and stay equal.
PowerSGD (stage 0) all-reduces each bucket's P factors (with its 1-D and
small tensors, uncompressed), then its Q factors.

[Note: error feedback state]
int8 keeps, per bucket and rank, an fp32 residual the size of the full
gradient buffer (what it could not send; its own chunk's stays 0), at stage 0
also one chunk-sized residual for the owner's all-gather; PowerSGD keeps an
error per compressed matrix and the warm-start Q's. ``memory_report()``
counts them under ``grads``. They are saved in each rank's checkpoint file
and restored when the checkpoint is loaded at the same world size and
compression; otherwise they restart from zero (a warning says so), which
only costs the transient error of the first steps. With fp16 loss scaling the
residuals are kept in the current loss scale's units: rescaled when it changes.

Hybrid sharding with compressed gradients is refused (config.py); int8
parameter gathers run in the shard group like the exact ones.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from . import codecs as codec
from ..communicator import Communicator
from ..work import Work
from ...policies import Compression
from ...flat.bucket import FlatBucket
from ..hybrid import GroupBytes, HybridCommunicator
from ...memory import LiveBytes, nbytes
from .powersgd import PowerSGDState, plan_powersgd

LOW_PRECISION = ("bf16", "fp16")


class CompressedCollectives:
    """One engine's compressed collectives and their state (see the module's Notes)."""

    def __init__(self, compression: Compression, comm: HybridCommunicator, all_reduces: bool,
                 buckets: list[FlatBucket], loss_scale: Callable[[], float], live: Optional[LiveBytes] = None):
        """``all_reduces``: gradients are all-reduced over every rank (stage 0's
        ``StageSpec.steps_whole``); else reduce-scattered over the shard group."""
        self.compression, self.all_reduces = compression, all_reduces
        self._live = live or LiveBytes()  # the engine's transient-buffer count (memory_report)
        # A shard group of one gathers nothing over the wire: its parameters stay exact.
        self.grads = compression.grads
        self.params = compression.params if comm.group_size > 1 else None
        self.block_size = compression.block_size
        # Stage 0 reduces over all ranks (counted there, like its exact all-reduce); stages 1-3
        # over the shard group, which is every rank (hybrid sharding is refused for gradients).
        self._grad_comm: Communicator = comm.world if all_reduces else comm.shard
        self._grad_group = "all_ranks" if all_reduces else "intra_group"
        self._comm = comm
        self._index = {id(bucket): i for i, bucket in enumerate(buckets)}
        self._loss_scale = loss_scale
        self._feedback: dict[int, codec.ErrorFeedback] = {}
        self._owner_feedback: dict[int, codec.ErrorFeedback] = {}   # stage 0 int8: the all-gather's
        self._scale_of_state: dict[int, float] = {}                 # loss scale the residuals are in
        self._powersgd: dict[int, PowerSGDState] = {}
        if self.grads == "powersgd":
            for bucket in buckets:
                if bucket.requires_grad:
                    plan = plan_powersgd([tuple(p.shape) for p in bucket.params], compression.powersgd_rank,
                                         compression.powersgd_min_compression_rate)
                    self._powersgd[self._index[id(bucket)]] = PowerSGDState(plan, seed=0,
                                                                            device=bucket.full_param.device)

    @classmethod
    def create(cls, compression: Optional[Compression], comm: HybridCommunicator, all_reduces: bool,
               buckets: list[FlatBucket], loss_scale: Callable[[], float], live: LiveBytes
               ) -> Optional["CompressedCollectives"]:
        """For an engine whose config asks for ``compression``; None without, or on one rank."""
        if compression is None or comm.world_size == 1:
            return None
        return cls(compression, comm, all_reduces, buckets, loss_scale, live)

    # ------------------------------------------------------------------ gradients

    def reduce_scatter(self, bucket: FlatBucket, output: torch.Tensor) -> Work:
        """Stages 1-3: ``output`` = this rank's chunk of the sum of every rank's ``full_grad``."""
        return self._reduce_chunks(bucket, lambda total: output.copy_(total))

    def all_reduce(self, bucket: FlatBucket) -> Work:
        """Stage 0: ``bucket.full_grad`` = the sum over ranks, in place (the same on every rank)."""
        if self.grads == "powersgd":
            return self._powersgd_all_reduce(bucket)
        return self._reduce_chunks(bucket, lambda total: self._gather_sums(bucket, total))

    def _reduce_chunks(self, bucket: FlatBucket, on_sum: Callable[[torch.Tensor], object]) -> Work:
        comm, flat = self._grad_comm, bucket.full_grad
        rank, world = comm.rank, comm.world_size
        own = codec.split_chunks(flat, world)[rank]
        if self.grads == "int8":
            messages = codec.encode_reduce_scatter(flat, rank, world, self.block_size, self.feedback_for(bucket))
            send = _with_own_slot([None if m is None else codec.pack(m) for m in messages])
        else:
            send = _with_own_slot(codec.encode_low_precision(flat, rank, world, self._cast_policy))
        received = torch.empty_like(send)
        held = 2 * nbytes(send)
        self._live.add(held)
        work = comm.all_to_all(received, send, async_op=True)
        work.then(lambda: on_sum(self._decode_sum(own, received.chunk(world), rank)))
        return work.then(lambda: self._live.sub(held))

    def _decode_sum(self, own: torch.Tensor, received: tuple, rank: int) -> torch.Tensor:
        chunk = own.numel()
        if self.grads == "int8":
            messages = [None if src == rank else codec.unpack(m, chunk, self.block_size)
                        for src, m in enumerate(received)]
            return codec.decode_reduce_scatter(own, messages)
        messages = [None if src == rank else m for src, m in enumerate(received)]
        return codec.decode_low_precision(own, messages, self._cast_policy)

    def _gather_sums(self, bucket: FlatBucket, total: torch.Tensor) -> None:
        """Stage 0's second half: every owner's sum, in the wire format, into ``full_grad``."""
        comm, flat = self._grad_comm, bucket.full_grad
        if self.grads == "int8":
            quantized = self._owner_feedback_for(bucket, total.numel()).quantize(total, self.block_size)
            message = codec.pack(quantized)
            gathered = torch.empty(comm.world_size * message.numel(), dtype=torch.uint8, device=flat.device)
            comm.all_gather(gathered, message)
            received = [codec.unpack(m, total.numel(), self.block_size) for m in gathered.chunk(comm.world_size)]
            flat.copy_(codec.decode_all_gather(received))
        else:
            message = total.to(self._cast_policy.wire)
            gathered = torch.empty(comm.world_size * message.numel(), dtype=message.dtype, device=flat.device)
            comm.all_gather(gathered, message)
            flat.copy_(gathered)

    @property
    def _cast_policy(self) -> codec.CastPolicy:
        return codec.cast_policy(self.grads)

    def feedback_for(self, bucket: FlatBucket) -> codec.ErrorFeedback:
        """The bucket's error-feedback residual, in the units of the current loss scale."""
        index = self._index[id(bucket)]
        if index not in self._feedback:
            self._feedback[index] = codec.ErrorFeedback(bucket.full_grad.numel(), bucket.full_grad.device)
        self._follow_loss_scale(index)
        return self._feedback[index]

    def _owner_feedback_for(self, bucket: FlatBucket, numel: int) -> codec.ErrorFeedback:
        index = self._index[id(bucket)]
        if index not in self._owner_feedback:
            self._owner_feedback[index] = codec.ErrorFeedback(numel, bucket.full_grad.device)
        return self._owner_feedback[index]

    def _follow_loss_scale(self, index: int) -> None:
        """fp16: residuals recorded under another loss scale are put into the current one's units."""
        scale = self._loss_scale()
        before = self._scale_of_state.setdefault(index, scale)
        if before != scale:
            for residuals in (self._feedback, self._owner_feedback):
                if index in residuals:
                    residuals[index].rescale(scale / before)
            self._scale_of_state[index] = scale

    def _powersgd_all_reduce(self, bucket: FlatBucket) -> Work:
        comm, state = self._grad_comm, self._powersgd[self._index[id(bucket)]]
        views = [bucket.grad_view(i) for i in range(len(bucket.params))]
        p_flat = _flat([p for p in state.compute_p(views)], bucket.full_grad.device)
        dense = _flat([views[i].to(torch.float32) for i in state.plan.dense], bucket.full_grad.device)
        works = [comm.all_reduce(t, async_op=True) for t in (p_flat, dense) if t.numel()]

        def finish() -> None:
            for work in works[1:]:
                work.wait()
            ps = _split(p_flat, [(m.rows, m.rank) for m in state.plan.matrices])
            q_flat = _flat(state.compute_q(ps), bucket.full_grad.device)
            if q_flat.numel():
                comm.all_reduce(q_flat)
            approximations = state.decompress(_split(q_flat, [(m.cols, m.rank) for m in state.plan.matrices]))
            for m, approximation in zip(state.plan.matrices, approximations):
                views[m.index].copy_(approximation)
            dense_sums = _split(dense, [tuple(state.plan.shapes[i]) for i in state.plan.dense])
            for index, summed in zip(state.plan.dense, dense_sums):
                views[index].copy_(summed)

        first = works[0] if works else Work(comm, "all_reduce")
        return first.then(finish)

    # ------------------------------------------------------------------ parameters (stage 3)

    def all_gather_params(self, bucket: FlatBucket) -> Work:
        """``bucket.full_param`` = every rank's shard, int8-quantized once (the shards stay exact)."""
        comm = self._comm
        shard = bucket.fill_own_chunk()
        message = codec.pack(codec.quantize_blockwise(shard.reshape(-1), self.block_size))
        gathered = torch.empty(comm.group_size * message.numel(), dtype=torch.uint8, device=shard.device)
        self._live.add(nbytes(gathered))
        work = comm.all_gather(gathered, message, async_op=True)

        def decode() -> None:
            received = [codec.unpack(m, shard.numel(), self.block_size) for m in gathered.chunk(comm.group_size)]
            bucket.full_param.copy_(codec.decode_all_gather(received, bucket.full_param.dtype))
            self._live.sub(nbytes(gathered))

        return work.then(decode)

    # ------------------------------------------------------------------ bytes

    def gradient_bytes(self, buckets: list[FlatBucket]) -> GroupBytes:
        """What one reduction of these buckets sends per rank (the counters' terms)."""
        comm, world = self._grad_comm, self._grad_comm.world_size
        total = 0
        for bucket in buckets:
            if self.grads == "powersgd":
                total += self._powersgd[self._index[id(bucket)]].plan.wire_bytes(world)
                continue
            message = self._message_bytes(bucket.layout.padded_numel // world)
            total += comm.bytes_sent("all_to_all", world * message)
            if self.all_reduces:
                total += comm.bytes_sent("all_gather", world * message)
        return GroupBytes(**{self._grad_group: total})

    def _message_bytes(self, chunk: int) -> int:
        if self.grads == "int8":
            return codec.payload_bytes(chunk, self.block_size)
        return chunk * self._cast_policy.wire.itemsize

    def gather_bytes(self, buckets: list[FlatBucket]) -> GroupBytes:
        """What one int8 all-gather of these buckets' parameters sends per rank."""
        k = self._comm.group_size
        return sum((self._comm.bytes_sent("all_gather", k * codec.payload_bytes(b.layout.padded_numel // k,
                                                                                   self.block_size))
                    for b in buckets), GroupBytes())

    # ------------------------------------------------------------------ state

    def state_bytes(self) -> int:
        """Bytes of the state carried between steps (residuals, PowerSGD errors and Q's)."""
        tensors = [fb.residual for fb in (*self._feedback.values(), *self._owner_feedback.values())]
        for state in self._powersgd.values():
            saved = state.state_dict()
            tensors += [*saved["errors"].values(), *saved["q"].values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict:
        """This rank's state (plain data and tensors, for a checkpoint's rank file)."""
        return {"compression": repr(self.compression), "world": self._grad_comm.world_size,
                "feedback": {i: fb.residual for i, fb in self._feedback.items()},
                "owner_feedback": {i: fb.residual for i, fb in self._owner_feedback.items()},
                "loss_scale": dict(self._scale_of_state),
                "powersgd": {i: state.state_dict() for i, state in self._powersgd.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore :meth:`state_dict`; a missing or mismatched one restarts from zero, with a warning."""
        why = self._mismatch(state)
        if why:
            warnings.warn(f"compression state restarts from zero: {why}", stacklevel=2)
            self._feedback, self._owner_feedback, self._scale_of_state = {}, {}, {}
            for state_of in self._powersgd.values():
                state_of.load_state_dict({"errors": {}, "q": {}})
            return
        self._feedback = {i: _feedback_of(r) for i, r in state["feedback"].items()}
        self._owner_feedback = {i: _feedback_of(r) for i, r in state["owner_feedback"].items()}
        self._scale_of_state = {i: float(s) for i, s in state["loss_scale"].items()}
        for i, saved in state["powersgd"].items():
            self._powersgd[i].load_state_dict(saved)

    def _mismatch(self, state: Optional[dict]) -> Optional[str]:
        if state is None:
            return "the checkpoint holds none for this rank"
        if state["compression"] != repr(self.compression) or state["world"] != self._grad_comm.world_size:
            return (f"it was saved with {state['compression']} on {state['world']} ranks, this run has "
                    f"{self.compression!r} on {self._grad_comm.world_size}")
        if set(state["powersgd"]) != set(self._powersgd) or any(
                i not in self._index.values() for i in (*state["feedback"], *state["owner_feedback"])):
            return "its buckets differ from this model's"
        return None


def _with_own_slot(messages: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """The all-to-all input: the messages in rank order, an unused slot for the own chunk."""
    sample = next(m for m in messages if m is not None)
    return torch.cat([torch.empty_like(sample) if m is None else m for m in messages])


def _flat(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, device=device)
    return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])


def _split(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def _feedback_of(residual: torch.Tensor) -> codec.ErrorFeedback:
    feedback = codec.ErrorFeedback(residual.numel(), residual.device)
    feedback.load_state_dict({"residual": residual})
    return feedback
