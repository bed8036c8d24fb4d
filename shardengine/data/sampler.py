"""Uneven data: each rank draws its own proportion of a dataset.

:class:`ProportionalSampler` is ``DistributedSampler`` with shares that need
not be equal: every epoch one permutation of the dataset (the same on every
rank, from ``seed + epoch``) is cut into consecutive pieces, rank r's piece
holding its share (rounded as in [Note: largest-remainder rounding],
proportions.py), so every sample is seen exactly once per epoch. It never
pads with repeated samples: ranks with fewer samples run out earlier, which
the engine's join and sample-weighted averaging are for. Shares that follow
each rank's speed: :func:`~shardengine.data.proportions.rebalance_proportions`.

>>> ProportionalSampler(range(10), [.25, .25, .10, .40], shuffle=False, rank=3, num_replicas=4).indices()
[6, 7, 8, 9]
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Sized

import torch
from torch.utils.data import Sampler

from ..distributed import launch as comm
from ..errors import ConfigError
from .proportions import check_proportions, proportional_counts


class ProportionalSampler(Sampler[int]):
    """Rank ``rank``'s share of ``dataset``, ``proportions[rank]``; every sample once per epoch.

    rank, num_replicas: default to this process's rank and the world size.
    proportions: one share per rank, >= 0, summing to 1; None means equal shares.
        Every rank must use the same proportions (and seed, and epoch).
    shuffle: a new permutation each epoch (call :meth:`set_epoch`), the same on all ranks.
    drop_last: each rank takes only the floor of its quota; the few samples left
        over (fewer than the number of ranks) are skipped that epoch.

    >>> import torch
    >>> loaders = [torch.utils.data.DataLoader(range(20), batch_size=4, sampler=ProportionalSampler(
    ...     range(20), [.7, .3], seed=1, rank=rank, num_replicas=2)) for rank in range(2)]
    >>> [len(loader.sampler) for loader in loaders], [len(loader) for loader in loaders]
    ([14, 6], [4, 2])
    >>> sorted(i for loader in loaders for batch in loader for i in batch.tolist()) == list(range(20))
    True
    """

    def __init__(self, dataset: Sized, proportions: Optional[Sequence[float]] = None, shuffle: bool = True,
                 seed: int = 0, rank: Optional[int] = None, num_replicas: Optional[int] = None,
                 drop_last: bool = False):
        self.num_replicas = comm.world_size() if num_replicas is None else num_replicas
        self.rank = comm.rank() if rank is None else rank
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ConfigError(f"num_replicas must be an int >= 1, got {self.num_replicas!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.num_replicas:
            raise ConfigError(f"rank must be an int in [0, {self.num_replicas - 1}], got {self.rank!r}")
        if not hasattr(dataset, "__len__"):
            raise ConfigError(f"ProportionalSampler needs a dataset with a length, got {type(dataset).__name__}")
        self.dataset, self.shuffle, self.seed, self.drop_last = dataset, shuffle, seed, drop_last
        self.epoch = 0
        self.set_proportions(proportions)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s permutation from the next iteration on (call it on every rank)."""
        self.epoch = epoch

    def set_proportions(self, proportions: Optional[Sequence[float]]) -> None:
        """New shares from the next iteration on; every rank must set the same ones."""
        if proportions is None:
            proportions = [1 / self.num_replicas] * self.num_replicas
        self.proportions = check_proportions(proportions, self.num_replicas)

    def counts(self) -> list[int]:
        """Samples per rank this epoch."""
        return proportional_counts(len(self.dataset), self.proportions, self.drop_last)

    def indices(self) -> list[int]:
        """This rank's dataset indices for the current epoch, in order."""
        counts = self.counts()
        start = sum(counts[:self.rank])
        return self._order()[start:start + counts[self.rank]].tolist()

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # as DistributedSampler
        return torch.randperm(len(self.dataset), generator=generator)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.counts()[self.rank]
