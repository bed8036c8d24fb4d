"""The only module that calls ``torch.distributed``.

Everything else talks to a :class:`Communicator`: collectives on whole flat
buffers, each one counted in bytes sent per rank (ring model) and in seconds
spent, so a step's traffic can be compared with theory.

[Note: ring-model byte accounting]
For a buffer of S bytes on N ranks a ring all-reduce sends 2(N-1)/N*S bytes
per rank, a reduce-scatter (S = the full input) and an all-gather (S = the
full output) each send (N-1)/N*S, and a pipelined broadcast (N-1)/N*S on
average. We count what the implementation we actually call would send in that
model, so when a backend-specific implementation swaps one collective for
another, the counters follow the collective really issued.

>>> comm = Communicator.local()          # world size 1, no process group
>>> import torch; t = torch.ones(4)
>>> comm.all_reduce(t).wait(); t.tolist()
[1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDENGINE_TIMEOUT_S", 600))


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


def current_backend() -> Optional[str]:
    return dist.get_backend() if dist.is_initialized() else None


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0


# --------------------------------------------------------------------------- statistics


@dataclass
class CommStats:
    """Cumulative traffic of one communicator, per collective kind."""

    bytes_by_kind: Counter = field(default_factory=Counter)
    calls_by_kind: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def calls(self) -> int:
        return sum(self.calls_by_kind.values())

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes_by_kind[kind] += nbytes
        self.calls_by_kind[kind] += 1

    def snapshot(self) -> "CommStats":
        return CommStats(Counter(self.bytes_by_kind), Counter(self.calls_by_kind), self.seconds)

    def since(self, earlier: "CommStats") -> "CommStats":
        """Traffic between ``earlier`` (a snapshot) and now."""
        return CommStats(self.bytes_by_kind - earlier.bytes_by_kind,
                         self.calls_by_kind - earlier.calls_by_kind,
                         self.seconds - earlier.seconds)

    def as_dict(self) -> dict[str, Any]:
        return {"bytes_by_kind": dict(self.bytes_by_kind), "calls_by_kind": dict(self.calls_by_kind),
                "bytes_total": self.bytes_total, "seconds": self.seconds}


def ring_bytes(kind: str, full_bytes: int, world: int) -> int:
    """Bytes one rank sends for a collective over ``full_bytes`` (see the Note above)."""
    if world == 1:
        return 0
    factor = 2 if kind == "all_reduce" else 1
    return factor * (world - 1) * full_bytes // world


# --------------------------------------------------------------------------- collectives


class Work:
    """Handle of a (possibly asynchronous) collective; ``wait()`` is idempotent."""

    def __init__(self, comm: "Communicator", kind: str, handle: Any, on_done=None):
        self._comm, self._kind, self._handle, self._on_done = comm, kind, handle, on_done

    def then(self, on_done) -> "Work":
        """Run ``on_done()`` once the collective has completed (at ``wait()``)."""
        self._on_done = on_done
        return self

    def wait(self) -> None:
        if self._handle is not None:
            started = time.perf_counter()
            try:
                self._handle.wait()
            except RuntimeError as error:
                raise self._comm.explain(self._kind, error) from error
            finally:
                self._comm.stats.seconds += time.perf_counter() - started
            self._handle = None
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()


class Communicator:
    """Collectives over one process group, with byte and time counters.

    Sums only: callers divide for averages (Gloo has no AVG reduction).
    """

    def __init__(self, group: Any = None, timeout_s: Optional[float] = None):
        self.group = group
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else None
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        self.stats = CommStats()

    @classmethod
    def local(cls) -> "Communicator":
        comm = cls.__new__(cls)
        comm.group, comm.distributed, comm.rank, comm.world_size = None, False, 0, 1
        comm.backend, comm.timeout_s, comm.stats = None, DEFAULT_TIMEOUT_S, CommStats()
        return comm

    @classmethod
    def with_timeout(cls, timeout_s: float) -> "Communicator":
        """A communicator on a new group spanning all ranks, with its own timeout."""
        if not dist.is_initialized():
            return cls.local()
        group = dist.new_group(timeout=timedelta(seconds=timeout_s))
        return cls(group, timeout_s)

    def explain(self, kind: str, error: Exception) -> CollectiveError:
        return CollectiveError(
            f"rank {self.rank}/{self.world_size}: {kind} failed ({error}). A peer rank may have "
            f"crashed, be stuck, or have skipped this collective (ranks must run the same "
            f"forward/backward control flow); collective timeout is {self.timeout_s:.0f}s.")

    # -- one entry per collective; each records its bytes and runs under _issue

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Work:
        """Sum ``tensor`` across ranks, in place."""
        self.stats.record("all_reduce", ring_bytes("all_reduce", _nbytes(tensor), self.world_size))
        if not self.distributed:
            return Work(self, "all_reduce", None)
        return self._issue("all_reduce", async_op, dist.all_reduce, tensor, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        self.stats.record("all_reduce", ring_bytes("all_reduce", _nbytes(tensor), self.world_size))
        if self.distributed:
            self._issue("all_reduce", False, dist.all_reduce, tensor, op=dist.ReduceOp.MAX,
                        group=self.group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` (one shard) = this rank's shard of the sum of every rank's ``input``."""
        self.stats.record("reduce_scatter", ring_bytes("reduce_scatter", _nbytes(input), self.world_size))
        if not self.distributed:
            output.copy_(input)
            return Work(self, "reduce_scatter", None)
        if self.backend == "gloo":
            # Gloo: the list form is ~2x faster than the single-tensor form (ARCHITECTURE.md §2).
            return self._issue("reduce_scatter", async_op, dist.reduce_scatter, output,
                               list(input.chunk(self.world_size)), group=self.group)
        return self._issue("reduce_scatter", async_op, _reduce_scatter_single, output, input,
                           group=self.group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` = every rank's ``input`` shard, concatenated in rank order."""
        self.stats.record("all_gather", ring_bytes("all_gather", _nbytes(output), self.world_size))
        if not self.distributed:
            output.copy_(input)
            return Work(self, "all_gather", None)
        if self.backend == "gloo":
            return self._issue("all_gather", async_op, dist.all_gather,
                               list(output.chunk(self.world_size)), input, group=self.group)
        return self._issue("all_gather", async_op, _all_gather_single, output, input, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy ``tensor`` from group rank ``src`` to every rank, in place."""
        self.stats.record("broadcast", ring_bytes("broadcast", _nbytes(tensor), self.world_size))
        if self.distributed:
            global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
            self._issue("broadcast", False, dist.broadcast, tensor, src=global_src, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (for wrap-time checks, not the hot path)."""
        if not self.distributed:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj, group=self.group)
        except RuntimeError as error:
            raise self.explain("all_gather_object", error) from error
        return gathered

    def _issue(self, kind: str, async_op: bool, collective, *args, **kwargs) -> Work:
        started = time.perf_counter()
        try:
            handle = collective(*args, async_op=async_op, **kwargs)
            work = Work(self, kind, handle)
            if not async_op:
                work._handle = None
            return work
        except RuntimeError as error:
            raise self.explain(kind, error) from error
        finally:
            self.stats.seconds += time.perf_counter() - started


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _reduce_scatter_single(output, input, group=None, async_op=False):
    # torch 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def _all_gather_single(output, input, group=None, async_op=False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)
