"""Joining the process group, and helpers over the default group.

The launcher's environment (torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``,
or SLURM's) decides the world; :func:`init_distributed` joins it. The
``*_default_group`` helpers serve checks that run before the engine has a
process group of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveError

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
