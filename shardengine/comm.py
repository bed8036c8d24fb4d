"""The only module that calls ``torch.distributed``.

Everything else talks to a :class:`Communicator`: collectives on whole flat
buffers, each one counted in bytes sent per rank (ring model) and in seconds
spent, so a step's traffic can be compared with theory.

[Note: ring-model byte accounting]
For a buffer of S bytes on N ranks a ring all-reduce sends 2(N-1)/N*S bytes
per rank, a reduce-scatter (S = the full input), an all-gather (S = the
full output) and an all-to-all (S = the full input) each send (N-1)/N*S,
and a pipelined broadcast (N-1)/N*S on average. We count what the
implementation we actually call would send in that model, so when a
backend-specific implementation swaps one collective for another, the
counters follow the collective really issued.

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

import copy
import os
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

# [Note: the default group at exit]
# torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments
# when it is first imported. torch imports it lazily (through torch._dynamo, when an
# optimizer is first built); if that happens after init_process_group, its functions
# hold the default group for ever, destroy_process_group() cannot free it, and its
# Gloo threads are still running at interpreter exit: one of them then frees a
# finished work, needs the GIL and calls std::terminate (SIGABRT). Imported here,
# with ``import shardengine``, before any group exists, the defaults are None. A
# group created before ``import shardengine`` is caught in them: we say so.
if dist.is_available():
    import torch.distributed.nn.functional as _dist_nn_functional

    if any(isinstance(d, dist.ProcessGroup) for d in _dist_nn_functional.all_reduce.__defaults__ or ()):
        import warnings
        warnings.warn("the default process group was created before torch.distributed.nn was imported, "
                      "which keeps it alive past destroy_process_group(); the process may then abort at "
                      "exit. Import shardengine before creating the group.", stacklevel=2)

DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDENGINE_TIMEOUT_S", 600))
GROUP_SETUP_TIMEOUT_S = 300.0


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message says which and why it may have."""


# --------------------------------------------------------------------------- process group


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: Optional[str]
    device: torch.device


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def _launcher_ranks() -> Optional[tuple[int, int, int]]:
    """(rank, world, local_rank) from torchrun's or SLURM's environment, if any."""
    rank = _env_int("RANK", "SLURM_PROCID")
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        return None
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID") or 0
    return rank, world, local


def _set_slurm_rendezvous() -> None:
    # torchrun sets MASTER_ADDR/PORT; under plain srun we use the launch node.
    if "MASTER_ADDR" not in os.environ and "SLURM_LAUNCH_NODE_IPADDR" in os.environ:
        os.environ["MASTER_ADDR"] = os.environ["SLURM_LAUNCH_NODE_IPADDR"]
    os.environ.setdefault("MASTER_PORT", "29500")


def init_distributed(backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Join the process group described by torchrun's or SLURM's environment.

    NCCL when CUDA is available, else Gloo. Without a launcher environment this
    is a world of size 1 and no process group is created. Calling it again
    returns the same answer.

    >>> info = init_distributed()   # doctest: +SKIP
    >>> info.world_size             # doctest: +SKIP
    1
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not dist.is_initialized():
        ranks = _launcher_ranks()
        if ranks is None or ranks[1] == 1 and "MASTER_ADDR" not in os.environ:
            return _dist_info(None)
        rank, world, local_rank = ranks
        _set_slurm_rendezvous()
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), store=_store_for_this_attempt(world))
    return _dist_info(dist.get_backend())


def _store_for_this_attempt(world: int):
    """Under torchrun, the agent's store seen through a prefix unique to this restart.

    [Note: torchrun restarts and stale store keys]
    After a restart (``--max-restarts``) the workers get the same agent TCPStore,
    which still holds the previous attempt's Gloo addresses; a rank that reads its
    peer's stale address before the peer overwrites it fails ``connectFullMesh``
    ("Connection refused"), attempt after attempt. A prefix per attempt keeps them
    apart. Outside torchrun: None (the usual env:// rendezvous).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timedelta(seconds=60))
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _dist_info(backend: Optional[str]) -> DistInfo:
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID") or 0
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(rank(), world_size(), local_rank, backend, device)


def all_gather_bytes_default_group(data: bytes) -> list[bytes]:
    """Every rank's ``data`` (the same length on every rank), in rank order: one all-gather
    over the default group. For checks that run before any other group is created."""
    if not dist.is_initialized():
        return [data]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    mine = torch.tensor(list(data), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(gathered, mine)
    except RuntimeError as error:
        raise _default_group_error("all_gather", error) from error
    return [bytes(t.cpu().tolist()) for t in gathered]


def all_gather_object_default_group(obj: Any) -> list[Any]:
    """Every rank's ``obj`` over the default group (for error reports, not the hot path)."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, obj)
    except RuntimeError as error:
        raise _default_group_error("all_gather_object", error) from error
    return gathered


def _default_group_error(kind: str, error: Exception) -> CollectiveError:
    return CollectiveError(f"rank {dist.get_rank()}/{dist.get_world_size()}: {kind} over the default group "
                           f"failed ({error}). A peer rank may have crashed or not have called shard().")


def current_backend() -> Optional[str]:
    return dist.get_backend() if dist.is_initialized() else None


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0


def local_world_size() -> Optional[int]:
    """Ranks on this node as the launcher says (torchrun's ``LOCAL_WORLD_SIZE``, or SLURM's
    ``SLURM_NTASKS_PER_NODE`` under plain srun); None without a launcher."""
    return _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


# --------------------------------------------------------------------------- statistics


@dataclass
class CommStats:
    """Cumulative traffic of one communicator, per collective kind.

    ``by_group``: the same split by the group the collectives ran over (filled
    for the engine's :class:`~shardengine.hybrid_comm.HybridCommunicator`:
    ``intra_group``, ``inter_group``, ``all_ranks``); the top-level counters are
    their sum.
    """

    bytes_by_kind: Counter = field(default_factory=Counter)
    calls_by_kind: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    by_group: dict[str, "CommStats"] = field(default_factory=dict)

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def calls(self) -> int:
        return sum(self.calls_by_kind.values())

    def record(self, kind: str, nbytes: int, calls: int = 1) -> None:
        self.bytes_by_kind[kind] += nbytes
        self.calls_by_kind[kind] += calls

    def snapshot(self) -> "CommStats":
        return CommStats(Counter(self.bytes_by_kind), Counter(self.calls_by_kind), self.seconds,
                         {name: group.snapshot() for name, group in self.by_group.items()})

    def since(self, earlier: "CommStats") -> "CommStats":
        """Traffic between ``earlier`` (a snapshot) and now."""
        return CommStats(self.bytes_by_kind - earlier.bytes_by_kind,
                         self.calls_by_kind - earlier.calls_by_kind,
                         self.seconds - earlier.seconds,
                         {name: group.since(earlier.by_group.get(name, CommStats()))
                          for name, group in self.by_group.items()})

    @classmethod
    def combined(cls, groups: dict[str, "CommStats"]) -> "CommStats":
        """The sum of several groups' traffic, keeping each group's under ``by_group``."""
        total = cls(by_group={name: stats.snapshot() for name, stats in groups.items()})
        for stats in groups.values():
            total.bytes_by_kind.update(stats.bytes_by_kind)
            total.calls_by_kind.update(stats.calls_by_kind)
            total.seconds += stats.seconds
        return total

    def as_dict(self) -> dict[str, Any]:
        out = {"bytes_by_kind": dict(self.bytes_by_kind), "calls_by_kind": dict(self.calls_by_kind),
               "bytes_total": self.bytes_total, "seconds": self.seconds}
        if self.by_group:
            out["by_group"] = {name: stats.as_dict() for name, stats in self.by_group.items()}
        return out


def ring_bytes(kind: str, full_bytes: int, world: int) -> int:
    """Bytes one rank sends for a collective over ``full_bytes`` (see the Note above)."""
    if world == 1:
        return 0
    factor = 2 if kind == "all_reduce" else 1
    return factor * (world - 1) * full_bytes // world


# --------------------------------------------------------------------------- collectives


class Work:
    """Handle of one logical collective (one or more backend calls); ``wait()`` is idempotent."""

    def __init__(self, comm: "Communicator", kind: str, handles: tuple = ()):
        self._comm, self._kind = comm, kind
        self._handles = [handle for handle in handles if handle is not None]
        self._on_done: list = []
        self._done = False

    def then(self, on_done) -> "Work":
        """Run ``on_done()`` once the collective has completed (at ``wait()``, or now if it
        already has), after any callbacks registered before it."""
        self._on_done.append(on_done)
        if self._done:
            self.wait()
        return self

    def wait(self) -> None:
        if self._handles:
            started = time.perf_counter()
            try:
                for handle in self._handles:
                    handle.wait()
            except RuntimeError as error:
                raise self._comm.explain(self._kind, error) from error
            finally:
                self._comm.stats.seconds += time.perf_counter() - started
            self._handles = []
        self._done = True
        callbacks, self._on_done = self._on_done, []
        for on_done in callbacks:
            on_done()


COLLECTIVES = ("auto", "native")


def uses_in_place_primitives(collectives: str, backend: Optional[str]) -> bool:
    """Whether reduce-scatter and all-gather are built from all-reduce and broadcasts
    (see [Note: Gloo's in-place primitives])."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    return collectives == "auto" and backend == "gloo"


class Communicator:
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
        self.aborted: Optional[str] = None  # why this rank left the group (see abort())
        self._group_name = getattr(group, "group_name", None) or "default"

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
        comm.owns_group, comm.aborted, comm._group_name = False, None, "local"
        return comm

    @classmethod
    def create(cls, timeout_s: Optional[float] = None, collectives: str = "auto") -> "Communicator":
        """A communicator over all ranks, on a group of its own with the collective timeout.

        Its own group, so that :meth:`abort` can tear it down without touching the user's.
        """
        if not dist.is_initialized():
            return cls.local()
        timeout = timeout_s or DEFAULT_TIMEOUT_S
        # Creating the group waits for every rank to arrive, which under load or a slow
        # start can take longer than a short collective timeout; only collectives get it.
        group = dist.new_group(timeout=timedelta(seconds=max(timeout, GROUP_SETUP_TIMEOUT_S)))
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

    def _abort_key(self) -> str:
        """Where :meth:`abort` leaves its reason: one key per group, so a later group never reads it."""
        return f"{_ABORT_KEY}/{self._group_name}"

    def explain(self, kind: str, error: Exception) -> CollectiveError:
        peer = _peer_abort_reason(self._abort_key())
        cause = (f" A peer stopped: {peer}" if peer else " A peer rank may have crashed, be stuck, "
                 "or have skipped this collective (ranks must run the same forward/backward "
                 "control flow).")
        return CollectiveError(
            f"rank {self.rank}/{self.world_size}: {kind} failed ({error}).{cause} Collective "
            f"timeout is {self.timeout_s:.0f}s.")

    # -- one entry per collective; each records the bytes of what it issues

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, label: str = "all_reduce") -> Work:
        """Sum ``tensor`` across ranks, in place; counted under ``label``."""
        self.stats.record(label, ring_bytes("all_reduce", _nbytes(tensor), self.world_size))
        return self._start("all_reduce", async_op, [
            lambda: dist.all_reduce(tensor, group=self.group, async_op=True)])

    def all_reduce_max(self, tensor: torch.Tensor, label: str = "all_reduce") -> None:
        self.stats.record(label, ring_bytes("all_reduce", _nbytes(tensor), self.world_size))
        self._start("all_reduce", False, [
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)])

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
                lambda: dist.all_reduce(input, group=self.group, async_op=True)], on_done=copy_out)
        self._record("reduce_scatter", input)
        if not _same_elements(output, owned):
            return self._start("reduce_scatter", async_op, [self._native_reduce_scatter(output, input)])
        separate = torch.empty_like(output)  # in place: the backend gets an output of its own
        return self._start("reduce_scatter", async_op, [self._native_reduce_scatter(separate, input)],
                           on_done=lambda: output.copy_(separate))

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
                for src, chunk in enumerate(chunks)])
        self._record("all_gather", output)
        return self._start("all_gather", async_op, [self._native_all_gather(output, input)])

    def _native_all_gather(self, output: torch.Tensor, input: torch.Tensor):
        if self.backend == "gloo":  # the list form, a wash with the single-tensor one on Gloo
            chunks = list(output.chunk(self.world_size))
            return lambda: dist.all_gather(chunks, input, group=self.group, async_op=True)
        return lambda: _all_gather_single(output, input, group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """Chunk r of ``input`` goes to rank r; ``output``'s chunk r comes from rank r.

        Both are flat and split into ``world_size`` equal chunks. A rank's own chunk
        is copied locally, so it sends (N-1)/N of ``input`` (the compressed
        reduce-scatters of compressed_reduce.py are built on it).
        """
        if output.numel() != input.numel() or input.numel() % self.world_size or output.dtype != input.dtype:
            raise ValueError(f"all_to_all needs input and output of the same dtype and size, a multiple of "
                             f"{self.world_size}; got {input.numel()} {input.dtype} -> {output.numel()} {output.dtype}")
        self._record("all_to_all", input)
        if not self.distributed:
            output.copy_(input)
            return Work(self, "all_to_all")
        return self._start("all_to_all", async_op, [
            lambda: dist.all_to_all_single(output, input, group=self.group, async_op=True)])

    def broadcast(self, tensor: torch.Tensor, src: int = 0, label: str = "broadcast") -> None:
        """Copy ``tensor`` from group rank ``src`` to every rank, in place; counted under ``label``."""
        self.stats.record(label, ring_bytes("broadcast", _nbytes(tensor), self.world_size))
        self._start("broadcast", False, [
            lambda: dist.broadcast(tensor, src=self._global_rank(src), group=self.group, async_op=True)])

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

    def abort(self, reason: str) -> None:
        """Leave the group for good so peers waiting on this rank fail now, not at the timeout.

        Only a group this communicator created is torn down (the user's default group
        is theirs); the reason is left in the store for the peers' error messages.
        """
        if not self.distributed:
            return
        try:
            _default_store().set(self._abort_key(), reason)
        except Exception:  # noqa: BLE001 - best effort: the peers still get an error
            pass
        if self.group is not None and self.owns_group:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - already gone
                pass
            # torch dropped its reference; ours is weak, so the group goes now and its
            # sockets close: peers see it at once.
        self.aborted = reason

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (for wrap-time checks, not the hot path)."""
        if not self.distributed:
            return [obj]
        self._check_alive()
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj, group=self.group)
        except RuntimeError as error:
            raise self.explain("all_gather_object", error) from error
        return gathered

    def bytes_sent(self, collective: str, nbytes: int) -> int:
        """What the counters record for one ``collective`` ("all_reduce", "reduce_scatter",
        "all_gather" or "all_to_all") over a full buffer of ``nbytes``, as this communicator issues it."""
        if self.in_place_primitives and collective == "reduce_scatter":
            return ring_bytes("all_reduce", nbytes, self.world_size)
        if self.in_place_primitives and collective == "all_gather":  # one broadcast per chunk
            return self.world_size * ring_bytes("broadcast", nbytes // self.world_size, self.world_size)
        return ring_bytes(collective, nbytes, self.world_size)

    # -- plumbing

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        """Count ``kind`` over ``tensor`` (its full size; see the ring-model Note)."""
        self.stats.record(kind, ring_bytes(kind, _nbytes(tensor), self.world_size))

    def _check_alive(self) -> None:
        if self.aborted is not None:
            raise CollectiveError(self.aborted)

    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _start(self, kind: str, async_op: bool, issues: list, on_done=None) -> Work:
        """Issue the backend calls (asynchronously); wait for them unless ``async_op``."""
        handles = ()
        if self.distributed:
            self._check_alive()
            started = time.perf_counter()
            try:
                handles = tuple(issue() for issue in issues)
            except RuntimeError as error:
                raise self.explain(kind, error) from error
            finally:
                self.stats.seconds += time.perf_counter() - started
        work = Work(self, kind, handles)
        if on_done is not None:
            work.then(on_done)
        if not async_op:
            work.wait()
        return work


def group_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split by dtype, in first-seen order (what :meth:`Communicator.broadcast_coalesced`
    sends one collective for)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    return list(by_dtype.values())


_ABORT_KEY = "shardengine/abort_reason"


def _default_store():
    return dist.distributed_c10d._get_default_store()


def _peer_abort_reason(key: str) -> Optional[str]:
    """What a peer that stopped on purpose left in the store (see :meth:`Communicator.abort`)."""
    try:
        store = _default_store()
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    except Exception:  # noqa: BLE001 - no store, or it is gone with the peer
        return None
    return None


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
