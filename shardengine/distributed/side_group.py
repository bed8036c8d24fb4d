"""A process group outside the training world: the trainer rank that sends weights and rollout processes.

[Note: a group beside the training world]
A rollout process (an inference server, a generation worker on other GPUs) is not
one of the trainer's ranks: it must not take part in the trainer's collectives, and
the trainer's world must not wait for it. So the weights travel over a group of
their own, built from a TCP store at an address both sides know, as vLLM's
``StatelessProcessGroup`` and SGLang's ``init_weights_update_group`` build theirs:
rank 0 is the trainer rank that sends (it hosts the store), ranks 1.. are the
rollout processes. Nothing here touches the default group, so either side may
also run a training world of its own. Gloo on CPU, NCCL on GPU (the backend
follows the device).

>>> SideGroup.backend_for(torch.device("cpu"))
'gloo'
"""

from __future__ import annotations

import inspect
import pickle
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveError, ConfigError
from .traffic import CommStats, ring_bytes
from .work import Work

DEFAULT_GROUP_NAME = "shardengine-weights"


class SideGroup:
    """One rank's membership of a group outside the training world (see the module's Note)."""

    def __init__(self, group: Any, store: Any, rank: int, world_size: int, backend: str,
                 device: torch.device, timeout_s: float) -> None:
        self._group, self._store = group, store
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device, self.timeout_s = device, timeout_s
        self.stats = CommStats()  # what this rank sent, as a Communicator counts it
        self.registered = False

    @staticmethod
    def backend_for(device: torch.device) -> str:
        return "nccl" if device.type == "cuda" else "gloo"

    @classmethod
    def join(cls, address: str, rank: int, world_size: int, *, device: Optional[torch.device] = None,
             timeout_s: float = 600.0, name: str = DEFAULT_GROUP_NAME) -> "SideGroup":
        """Join the group at ``address`` (``"host:port"``) as ``rank`` of ``world_size``; rank 0
        hosts the store, so it must be able to listen on that port. Blocks until every rank joined.

        ``device``: where tensors travel (CPU: Gloo; a CUDA device: NCCL). ``name`` prefixes the
        store's keys, so one store may serve several groups.
        """
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"address must be 'host:port', got {address!r}")
        if not (isinstance(world_size, int) and world_size >= 2 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ConfigError(f"rank must be in [0, world_size) with world_size >= 2, got rank={rank!r}, "
                              f"world_size={world_size!r}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        backend = cls.backend_for(device)
        timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
        except (RuntimeError, OSError) as error:
            raise CollectiveError(f"rank {rank} of the weight group could not reach its store at {address} "
                                  f"({error}); rank 0 (the sending trainer rank) hosts it") from error
        prefixed = dist.PrefixStore(f"{name}/", store)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:  # one NCCL communicator over the group's ranks, on this rank's device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            torch.cuda.set_device(device)
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        return cls(group, store, rank, world_size, backend, device, timeout_s)

    @classmethod
    def join_custom(cls, address: str, rank: int, world_size: int, group_name: str, *,
                    device: Optional[torch.device] = None, timeout_s: float = 600.0) -> "SideGroup":
        """Join a weight group built as SGLang's ``init_weights_update_group`` (and OpenRLHF's, SkyRL's)
        build theirs: torch's TCP rendezvous at ``address``, a store prefixed with ``group_name``, and
        torch's own group helper, so an inference server's ranks and this one meet in one group."""
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                        rendezvous)

        device = torch.device(device) if device is not None else torch.device("cpu")
        backend, timeout = cls.backend_for(device), timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store, rank, world_size = next(rendezvous(f"tcp://{address}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        prefixed = PrefixStore(group_name, store)
        parameters = inspect.signature(_new_process_group_helper).parameters
        options = "backend_options" if "backend_options" in parameters else "pg_options"
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), prefixed, group_name=group_name,
                                             timeout=timeout, **{options: None})
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        joined = cls(group, store, rank, world_size, backend, device, timeout_s)
        joined.registered = True  # torch's registry holds it: destroy_process_group() releases it
        return joined

    # -- data

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False, label: str = "broadcast") -> Work:
        """Copy ``tensor`` from group rank ``src`` to every rank of the group, in place."""
        self._check_open()
        if self.rank == src:
            self.stats.record(label, ring_bytes("broadcast", tensor.numel() * tensor.element_size(), self.world_size))
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        try:
            work = Work(self, "broadcast", (self._group.broadcast([tensor], options),))
        except RuntimeError as error:
            raise self.explain("broadcast", error) from error
        if not async_op:
            work.wait()
        return work

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (pickled: small control messages, never weights)."""
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src, label="objects")
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src, label="objects")
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())

    def close(self) -> None:
        """Leave the group (idempotent); its collectives are refused afterwards."""
        group, self._group = self._group, None
        try:
            if group is not None and self.registered:
                dist.destroy_process_group(group)
            elif group is not None and hasattr(group, "shutdown"):
                group.shutdown()
        except (RuntimeError, ValueError):
            pass  # already torn down (by a peer, or destroy_process_group())

    # -- what Work needs of its communicator

    def wait_for(self, handle: Any) -> None:
        handle.wait()

    def explain(self, kind: str, error: Exception) -> CollectiveError:
        return CollectiveError(f"rank {self.rank}/{self.world_size} of the weight group: {kind} failed ({error}). "
                               "A peer may have stopped or left the group; the timeout is "
                               f"{self.timeout_s:.0f}s.")

    def _check_open(self) -> None:
        if self._group is None:
            raise CollectiveError(f"rank {self.rank} of the weight group already left it (close())")
