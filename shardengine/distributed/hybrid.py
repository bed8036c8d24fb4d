"""``HybridCommunicator``: the engine's collectives over three groups of ranks.

[Note: hybrid sharding]
With ``shard_group_size=k`` the N ranks form N/k *shard groups* of k consecutive
ranks (a node, typically); a flat bucket is laid out over the k ranks of a group,
and the groups are replicas of each other. Rank r = g·k + i (group g, position i)
has three communicators:

``shard``     the k ranks of its group (``intra_group``): the reduce-scatter of
              gradients, every all-gather of parameters, the clipping norm;
``replicas``  the N/k ranks at position i of every group (``inter_group``), which
              hold the same shard: the all-reduce of the reduced shards;
``world``     all N ranks (``all_ranks``): what every rank holds whole or must
              agree on (stage 0's gradients, the step's agreement, buffers and the
              wrap-time broadcast, fp16 overflow, checkpoint agreement).

A gradient is reduce-scattered in the group (the sum of the group's k
contributions, this rank's shard of it), then the shard is all-reduced across
the groups: the sum over all N ranks, as plain sharding gets, with only S/k per
rank crossing between groups. k = N is plain sharding: ``shard`` is the world's
group (with counters of its own) and ``replicas`` a group of one.

The collectives keep :class:`~shardengine.distributed.communicator.Communicator`'s names, defined by
the layout rather than by one group: :meth:`reduce_scatter` leaves in ``output``
this rank's shard of the sum over every rank, :meth:`all_gather` assembles every
shard of the layout, and everything else runs over all ranks.

>>> from shardengine.distributed.communicator import Communicator
>>> comm = HybridCommunicator.create(Communicator.local(), group_size=1)
>>> import torch; grad = torch.ones(4)
>>> comm.reduce_scatter(grad, grad).wait(); grad.tolist()
[1.0, 1.0, 1.0, 1.0]
>>> comm.bytes_sent("reduce_scatter", 16)
GroupBytes(intra_group=0, inter_group=0, all_ranks=0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .traffic import CommStats
from .communicator import Communicator
from .sequence import CollectiveSequence, OpId
from .work import Work

INTRA, INTER, ALL = "intra_group", "inter_group", "all_ranks"


@dataclass(frozen=True)
class GroupBytes:
    """Bytes a rank sends, by the group they travel in (see [Note: hybrid sharding])."""

    intra_group: int = 0
    inter_group: int = 0
    all_ranks: int = 0

    @property
    def total(self) -> int:
        return self.intra_group + self.inter_group + self.all_ranks

    def __add__(self, other: "GroupBytes") -> "GroupBytes":
        return GroupBytes(self.intra_group + other.intra_group, self.inter_group + other.inter_group,
                          self.all_ranks + other.all_ranks)

    def __radd__(self, other: Any) -> "GroupBytes":  # sum() starts from 0
        return self if other == 0 else self + other

    def __mul__(self, times: int) -> "GroupBytes":
        return GroupBytes(times * self.intra_group, times * self.inter_group, times * self.all_ranks)

    __rmul__ = __mul__

    def as_dict(self) -> dict[str, int]:
        return {INTRA: self.intra_group, INTER: self.inter_group, ALL: self.all_ranks}


class HybridCommunicator:
    """All ranks, this rank's shard group and its replica group (see the module's Note)."""

    def __init__(self, world: Communicator, shard: Communicator, replicas: Communicator):
        self.world, self.shard, self.replicas = world, shard, replicas
        self.sequence: Optional[CollectiveSequence] = None

    def check_order(self, server: Callable[[OpId], None],
                    describe: Callable[[OpId], str]) -> Optional[CollectiveSequence]:
        """Stage 3: a round before every collective of the shard group and of all ranks (see
        [Note: checked collective order] in sequence.py), over a Gloo group of all ranks made
        now (collective). The replica groups' all-reduces follow the shard groups' reductions,
        whose order the rounds fix, so they need none. Enabled by the caller once built. None on
        a fake process group (one process simulating N ranks: no peers to agree with)."""
        if self.world.backend == "fake":
            return None
        side = Communicator.create(self.world.timeout_s, "native", backend="gloo")
        # a round that stalls reads the world's control word: a peer that stopped, or an announced
        # call this rank went past (step/call_agreement.py), ends it as it ends any other wait
        side.channel = self.world.channel
        self.sequence = CollectiveSequence(side, server, describe)
        self.world.sequence = self.shard.sequence = self.sequence
        return self.sequence

    @classmethod
    def create(cls, world: Communicator, group_size: int, collectives: str = "auto") -> "HybridCommunicator":
        """Split ``world`` into groups of ``group_size`` consecutive ranks; collective.

        ``group_size`` must divide the world size (see ``config.resolve_shard_group_size``).
        """
        n, k = world.world_size, group_size
        if k < 1 or n % k:
            raise ValueError(f"group size {k} does not divide the world size {n}")
        if k == n:
            return cls(world, world.twin(), _local_like(world))
        groups = [list(range(g * k, (g + 1) * k)) for g in range(n // k)]
        replicas = [list(range(i, n, k)) for i in range(k)]
        shard = Communicator.create_partition(groups, world.timeout_s, collectives)
        across = Communicator.create_partition(replicas, world.timeout_s, collectives)
        for part in (shard, across):  # one control word for the engine: a rank stalled in its
            if part.distributed:      # group hears of a stop anywhere (distributed/channel.py)
                part.channel = world.channel
        return cls(world, shard, across)

    # -- who this rank is

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def group_size(self) -> int:
        """k: the ranks a flat bucket is sharded over."""
        return self.shard.world_size

    @property
    def group_index(self) -> int:
        """Which shard group this rank is in (0 .. N/k - 1); group 0 holds ranks 0 .. k-1."""
        return self.replicas.rank

    @property
    def distributed(self) -> bool:
        return self.world.distributed

    @property
    def backend(self) -> Optional[str]:
        return self.world.backend

    @property
    def timeout_s(self) -> float:
        return self.world.timeout_s

    @property
    def in_place_primitives(self) -> bool:
        return self.shard.in_place_primitives

    @property
    def reduces_in_place(self) -> bool:
        return self.shard.reduces_in_place

    # -- collectives of the layout

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` = this rank's shard of the sum of every rank's ``input``: a reduce-scatter
        in the shard group, then an all-reduce of the shard across the groups.

        The all-reduce starts when the reduce-scatter has been waited for (it needs its
        result); callbacks registered with ``then`` run after both.
        """
        work = self.shard.reduce_scatter(output, input, async_op=True)
        if self.replicas.world_size > 1:
            work.then(lambda: self.replicas.all_reduce(output).wait())
        if not async_op:
            work.wait()
        return work

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` = every shard of the layout (the shard group's), in rank order."""
        return self.shard.all_gather(output, input, async_op)

    # -- collectives over all ranks

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, label: str = "all_reduce") -> Work:
        return self.world.all_reduce(tensor, async_op, label)

    def all_reduce_max(self, tensor: torch.Tensor, label: str = "all_reduce") -> None:
        self.world.all_reduce_max(tensor, label)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, label: str = "broadcast") -> None:
        self.world.broadcast(tensor, src, label)

    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0, label: str = "broadcast") -> None:
        self.world.broadcast_coalesced(tensors, src, label)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.world.all_gather_object(obj)

    def count_true(self, flag: bool) -> int:
        return self.world.count_true(flag)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.world.broadcast_object(obj, src)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The result of an all-ranks collective on the host (see :meth:`Communicator.host_copy`)."""
        return self.world.host_copy(tensor)

    def abort(self, reason: str) -> None:
        """Leave every group for good (see :meth:`Communicator.abort`); the world's last, as
        the shard communicator may share its group."""
        if self.sequence is not None:
            self.sequence.side.abort(reason)
        for comm in (self.replicas, self.shard, self.world):
            comm.abort(reason)

    # -- accounting

    def bytes_sent(self, collective: str, nbytes: int) -> GroupBytes:
        """What the counters record for one of this communicator's ``collective`` ("all_reduce",
        "reduce_scatter" or "all_gather") over a full buffer of ``nbytes``, by group."""
        if collective == "all_reduce":
            return GroupBytes(all_ranks=self.world.bytes_sent("all_reduce", nbytes))
        if collective == "all_gather":
            return GroupBytes(intra_group=self.shard.bytes_sent("all_gather", nbytes))
        if collective != "reduce_scatter":
            raise ValueError(f"unknown collective {collective!r}")
        return GroupBytes(intra_group=self.shard.bytes_sent("reduce_scatter", nbytes),
                          inter_group=self.replicas.bytes_sent("all_reduce", nbytes // self.group_size))

    @property
    def stats(self) -> CommStats:
        """Every group's traffic summed, with each group's under ``by_group`` (a snapshot)."""
        return CommStats.combined({INTRA: self.shard.stats, INTER: self.replicas.stats, ALL: self.world.stats})

    def reset_stats(self) -> None:
        for comm in (self.shard, self.replicas, self.world):
            comm.stats = CommStats()


def _local_like(world: Communicator) -> Communicator:
    """A group of one rank (k = N: every shard is held once), with the world's timeout."""
    local = Communicator.local()
    local.timeout_s = world.timeout_s
    return local
