"""Collectives over one process group: the engine's only door to ``torch.distributed``.

Everything else talks to a :class:`Communicator`: collectives on whole flat
buffers, each one counted in bytes sent per rank (ring model, see traffic.py)
and in seconds spent, so a step's traffic can be compared with theory. The
``distributed`` package (this module, control.py, launch.py, abort.py) is the only code
that calls ``torch.distributed``.

[Note: Gloo's in-place primitives]
Gloo's all-reduce and broadcast work on the caller's tensor; its reduce-scatter
and all-gather go through a flat temporary and copy in and out, and measure
slower than the in-place primitives that replace them, although the ring model
says a reduce-scatter should take half as long as an all-reduce (the measured
table: docs/architecture.md, "On Gloo, only the in-place primitives";
``benchmarks/bench_collectives.py`` reproduces it).
So with ``collectives="auto"`` on Gloo an all-gather is N broadcasts (the same
(N-1)/N*S bytes per rank, counted as broadcasts) and a reduce-scatter is an
all-reduce (counted as one: 2(N-1)/N*S instead of (N-1)/N*S). NCCL, and any
other backend, gets the textbook collectives; ``collectives="native"`` forces
them on Gloo too.

>>> comm = Communicator.local()          # world size 1, no process group
>>> import torch; t = torch.ones(4)
>>> comm.all_reduce(t).wait(); t.tolist()
[1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import atexit
import copy
import time
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from .channel import ControlChannel
from .control import ControlPlane
from .launch import DEFAULT_TIMEOUT_S
from .sequence import CollectiveSequence, other_op
from .traffic import CommStats, bytes_sent, group_by_dtype, ring_bytes, uses_in_place_primitives
from .work import Work

GROUP_SETUP_TIMEOUT_S = 300.0


class Communicator(ControlPlane):
    """Collectives over one process group, with byte and time counters.

    Sums only: callers divide for averages (Gloo has no AVG reduction).
    ``collectives``: "auto" picks the fastest correct implementation for the
    backend; "native" issues the textbook collective everywhere.
    """

    def __init__(self, group: Any = None, timeout_s: Optional[float] = None, collectives: str = "auto"):
        # Weakly: torch holds the group until destroy_process_group(); a model that outlives
        # that must not keep its Gloo threads running into interpreter exit (see the Note).
        self._group_ref = weakref.ref(group) if group is not None else None
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else None
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        self.in_place_primitives = uses_in_place_primitives(collectives, self.backend)
        self.stats = CommStats()
        self.owns_group = group is not None
        self.sequence: Optional[CollectiveSequence] = None  # stage 3: rounds before collectives
        self.aborted: Optional[str] = None  # why this rank left the group (see abort())
        self._group_name = getattr(group, "group_name", None) or "default"
        # the engine's world polls it (a partition's group shares the world's: hybrid.py)
        self.channel = ControlChannel(self._group_name, self.world_size) if self.distributed else None
        # Destroyed once this communicator is collected (see the Note at _ORPHANED_GROUPS).
        self._release = weakref.finalize(self, _ORPHANED_GROUPS.append, self._group_ref) if self.owns_group else None
        if self.owns_group:
            _LIVE_OWNERS.add(self)

    @property
    def group(self) -> Any:
        """The process group (None: the default group)."""
        if self._group_ref is None:
            return None
        group = self._group_ref()
        if group is None:
            raise CollectiveError(f"rank {self.rank}: this model's process group was destroyed "
                                  "(destroy_process_group()); shard the model again in a new group")
        return group

    @property
    def reduces_in_place(self) -> bool:
        """An in-place :meth:`reduce_scatter` needs no buffer beyond its input."""
        return self.in_place_primitives or not self.distributed

    @classmethod
    def local(cls) -> "Communicator":
        comm = cls.__new__(cls)
        comm._group_ref, comm.distributed, comm.rank, comm.world_size = None, False, 0, 1
        comm.backend, comm.timeout_s, comm.stats = None, DEFAULT_TIMEOUT_S, CommStats()
        comm.in_place_primitives = False
        comm.owns_group, comm.aborted, comm._group_name, comm._release = False, None, "local", None
        comm.channel = None
        comm.sequence = None
        return comm

    @classmethod
    def create(cls, timeout_s: Optional[float] = None, collectives: str = "auto",
               backend: Optional[str] = None) -> "Communicator":
        """A communicator over all ranks, on a group of its own with the collective timeout
        (``backend``: the default group's unless given, e.g. "gloo" for a host-side group).

        Its own group, so that :meth:`abort` can tear it down without touching the user's.
        """
        if not dist.is_initialized():
            return cls.local()
        _destroy_orphaned_groups()
        timeout = timeout_s or DEFAULT_TIMEOUT_S
        # Creating the group waits for every rank to arrive, which under load or a slow
        # start can take longer than a short collective timeout; only collectives get it.
        group = dist.new_group(timeout=timedelta(seconds=max(timeout, GROUP_SETUP_TIMEOUT_S)), backend=backend)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout), group)
        return cls(group, timeout, collectives)

    @classmethod
    def create_partition(cls, parts: list[list[int]], timeout_s: Optional[float] = None,
                         collectives: str = "auto") -> "Communicator":
        """A communicator over the part of ``parts`` (lists of global ranks, together every
        rank once) that holds this rank; collective over all ranks.

        Every rank creates every part's group, in the same order (``new_group`` is
        collective over the default group); a part of one rank needs no group.
        """
        _destroy_orphaned_groups()
        me = dist.get_rank()
        timeout = timeout_s or DEFAULT_TIMEOUT_S
        mine = None
        for ranks in parts:
            if len(ranks) == 1:
                continue
            group = dist.new_group(ranks, timeout=timedelta(seconds=max(timeout, GROUP_SETUP_TIMEOUT_S)))
            if me in ranks:
                mine = group
        if mine is None:
            local = cls.local()
            local.timeout_s = timeout
            return local
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout), mine)
        return cls(mine, timeout, collectives)

    def twin(self) -> "Communicator":
        """A communicator over the same group with counters of its own; it never tears the
        group down (:meth:`abort` on the original does)."""
        twin = copy.copy(self)
        twin.stats, twin.owns_group = CommStats(), False
        return twin

    # -- one entry per collective; each records the bytes of what it issues

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, label: str = "all_reduce") -> Work:
        """Sum ``tensor`` across ranks, in place; counted under ``label``."""
        self.stats.record(label, ring_bytes("all_reduce", _nbytes(tensor), self.world_size))
        return self._start("all_reduce", async_op, [
            lambda: dist.all_reduce(tensor, group=self.group, async_op=True)], nbytes=_nbytes(tensor))

    def all_reduce_max(self, tensor: torch.Tensor, label: str = "all_reduce") -> None:
        self.stats.record(label, ring_bytes("all_reduce", _nbytes(tensor), self.world_size))
        self._start("all_reduce", False, [
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)],
            nbytes=_nbytes(tensor))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` (one shard) = this rank's shard of the sum of every rank's ``input``.

        ``input`` is scratch: what it holds afterwards is unspecified, except that
        ``output`` may be this rank's own chunk of it (an in-place reduce-scatter;
        with :attr:`reduces_in_place` that needs no extra buffer).
        """
        owned = input.chunk(self.world_size)[self.rank]
        copy_out = (lambda: None) if _same_elements(output, owned) else (lambda: output.copy_(owned))
        if not self.distributed:
            copy_out()
            self._record("reduce_scatter", input)
            return Work(self, "reduce_scatter")
        if self.in_place_primitives:  # the sum lands in ``owned``: output may be that very chunk
            self.stats.record("all_reduce", self.bytes_sent("reduce_scatter", _nbytes(input)))
            return self._start("reduce_scatter (as all_reduce)", async_op, [
                lambda: dist.all_reduce(input, group=self.group, async_op=True)], on_done=copy_out,
                nbytes=_nbytes(input))
        self._record("reduce_scatter", input)
        if not _same_elements(output, owned):
            return self._start("reduce_scatter", async_op, [self._native_reduce_scatter(output, input)],
                               nbytes=_nbytes(input))
        separate = torch.empty_like(output)  # in place: the backend gets an output of its own
        return self._start("reduce_scatter", async_op, [self._native_reduce_scatter(separate, input)],
                           on_done=lambda: output.copy_(separate), nbytes=_nbytes(input))

    def _native_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor):
        if self.backend == "gloo":  # the list form beats the single-tensor one on Gloo
            chunks = list(input.chunk(self.world_size))
            return lambda: dist.reduce_scatter(output, chunks, group=self.group, async_op=True)
        return lambda: _reduce_scatter_single(output, input, group=self.group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` = every rank's ``input`` shard, concatenated in rank order.

        ``input`` may be this rank's own chunk of ``output`` (an in-place gather).
        """
        chunks = output.chunk(self.world_size)
        if not self.distributed or self.in_place_primitives:
            if not _same_elements(chunks[self.rank], input):
                chunks[self.rank].copy_(input)
        if not self.distributed:
            self._record("all_gather", output)
            return Work(self, "all_gather")
        if self.in_place_primitives:  # each rank broadcasts its own chunk, in place
            self.stats.record("broadcast", self.bytes_sent("all_gather", _nbytes(output)), calls=len(chunks))
            return self._start("all_gather (as broadcasts)", async_op, [
                lambda src=src, chunk=chunk: dist.broadcast(chunk, src=self._global_rank(src),
                                                            group=self.group, async_op=True)
                for src, chunk in enumerate(chunks)], nbytes=_nbytes(output))
        self._record("all_gather", output)
        return self._start("all_gather", async_op, [self._native_all_gather(output, input)],
                           nbytes=_nbytes(output))

    def _native_all_gather(self, output: torch.Tensor, input: torch.Tensor):
        if self.backend == "gloo":  # the list form, a wash with the single-tensor one on Gloo
            chunks = list(output.chunk(self.world_size))
            return lambda: dist.all_gather(chunks, input, group=self.group, async_op=True)
        return lambda: _all_gather_single(output, input, group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """Chunk r of ``input`` goes to rank r; ``output``'s chunk r comes from rank r.

        Both are flat and split into ``world_size`` equal chunks. A rank's own chunk
        is copied locally, so it sends (N-1)/N of ``input`` (the compressed
        reduce-scatters of distributed/compression/collectives.py are built on it).
        """
        if output.numel() != input.numel() or input.numel() % self.world_size or output.dtype != input.dtype:
            raise ValueError(f"all_to_all needs input and output of the same dtype and size, a multiple of "
                             f"{self.world_size}; got {input.numel()} {input.dtype} -> {output.numel()} {output.dtype}")
        self._record("all_to_all", input)
        if not self.distributed:
            output.copy_(input)
            return Work(self, "all_to_all")
        return self._start("all_to_all", async_op, [
            lambda: dist.all_to_all_single(output, input, group=self.group, async_op=True)],
            nbytes=_nbytes(input))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, label: str = "broadcast", async_op: bool = False) -> Work:
        """Copy ``tensor`` from group rank ``src`` to every rank, in place; counted under ``label``."""
        self.stats.record(label, ring_bytes("broadcast", _nbytes(tensor), self.world_size))
        return self._start("broadcast", async_op, [
            lambda: dist.broadcast(tensor, src=self._global_rank(src), group=self.group, async_op=True)],
            nbytes=_nbytes(tensor))

    def send(self, tensor: torch.Tensor, dst: int, label: str = "send") -> Work:
        """Start sending ``tensor`` to group rank ``dst``, which posts a matching :meth:`recv`
        (point to point, asynchronous: ``tensor`` must stay untouched until the work is waited
        for); its bytes are counted under ``label``."""
        self.stats.record(label, _nbytes(tensor))
        return self._start("send", True, [
            lambda: dist.isend(tensor, self._global_rank(dst), group=self.group)])

    def recv(self, tensor: torch.Tensor, src: int) -> Work:
        """Start receiving into ``tensor`` what group rank ``src`` sends (asynchronous)."""
        return self._start("recv", True, [
            lambda: dist.irecv(tensor, self._global_rank(src), group=self.group)])

    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0, label: str = "broadcast") -> None:
        """Broadcast several small tensors from group rank ``src``: one collective per dtype."""
        for same in group_by_dtype(tensors):
            if len(same) == 1:
                self.broadcast(same[0], src, label)
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            self.broadcast(flat, src, label)
            offset = 0
            with torch.no_grad():
                for tensor in same:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    def bytes_sent(self, collective: str, nbytes: int) -> int:
        """What the counters record for one ``collective`` ("all_reduce", "reduce_scatter",
        "all_gather" or "all_to_all") over a full buffer of ``nbytes``, as this communicator issues it."""
        return bytes_sent(collective, nbytes, self.world_size, self.in_place_primitives)

    # -- plumbing

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        """Count ``kind`` over ``tensor`` (its full size; see the ring-model Note)."""
        self.stats.record(kind, ring_bytes(kind, _nbytes(tensor), self.world_size))

    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _start(self, kind: str, async_op: bool, issues: list, on_done=None, nbytes: int = 0) -> Work:
        """Issue the backend calls (asynchronously); wait for them unless ``async_op``. With a
        :attr:`sequence` (stage 3), once every rank issues the same (``kind``, ``nbytes``); a send
        and its matching receive differ by nature and pair by peer, so they hold no round."""
        handles = ()
        if self.distributed:
            self._check_alive()
            if kind in _POINT_TO_POINT:
                handles = self._issue(kind, issues)
            else:
                handles = self._in_order(other_op(kind, nbytes), lambda: self._issue(kind, issues))
        work = Work(self, kind, handles)
        if on_done is not None:
            work.then(on_done)
        if not async_op:
            work.wait()
        return work

    def _issue(self, kind: str, issues: list) -> tuple:
        started = time.perf_counter()
        try:
            return tuple(issue() for issue in issues)
        except RuntimeError as error:
            raise self.explain(kind, error) from error
        finally:
            self.stats.seconds += time.perf_counter() - started


_POINT_TO_POINT = frozenset({"send", "recv"})


# [Note: the groups of collected models]
# Each sharded model gets process groups of its own (so that abort() can tear them
# down without touching the user's). torch keeps a group, with its backend threads
# (four per Gloo group) and buffers (NCCL's, on the GPU), until
# destroy_process_group(); a process that shards model after model (a sweep, a
# notebook, a test suite) would keep every one: measured, 1,400 threads per rank
# after a few hundred models, and every collective slower for it. So when the
# communicator that created a group is garbage-collected, the group is queued here
# and destroyed at the next group creation: a point where no collective of this
# process is running (a finalizer may run anywhere, inside torch.distributed too).
# Not a group whose collectives failed: its stuck work would make the destruction
# wait for the collective timeout (measured: every rank blocked in the next shard()).
_ORPHANED_GROUPS: list = []  # weak references to groups whose owner was collected


_LIVE_OWNERS: "weakref.WeakSet[Communicator]" = weakref.WeakSet()  # owners of groups, for exit


@atexit.register
def _destroy_groups_at_exit() -> None:
    """Our healthy groups go before the interpreter does: a Gloo group still running at exit
    may free a finished work from its own thread, need the GIL and abort the process
    (measured: 2 of 7 runs of bench_integrations.py without this, 0 of 7 with it)."""
    for owner in list(_LIVE_OWNERS):
        if owner._release.alive:  # detached once the group failed (ControlPlane._keep_group)
            _ORPHANED_GROUPS.append(owner._group_ref)
            owner._release.detach()
    if dist.is_available() and dist.is_initialized():
        _destroy_orphaned_groups()


def _destroy_orphaned_groups() -> None:
    while _ORPHANED_GROUPS:
        group = _ORPHANED_GROUPS.pop()()
        if group is None:
            continue
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass  # already destroyed (abort, or by the user)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def _reduce_scatter_single(output, input, group=None):
    # torch 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=True)


def _all_gather_single(output, input, group=None):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=True)
