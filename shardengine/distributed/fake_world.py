"""One rank of a simulated world: torch's fake process group, in this process.

``torch.testing._internal.distributed.fake_pg`` answers every collective at once
without sending or reducing anything, so a model sharded over it allocates
exactly what one rank of ``world_size`` allocates, but its values are this
rank's alone (no averaging): good for memory, never for correctness.

>>> with fake_world(4):
...     world_size()
4
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from .launch import world_size

__all__ = ["fake_world", "world_size"]


@contextlib.contextmanager
def fake_world(size: int) -> Iterator[None]:
    """Rank 0 of ``size`` fake ranks for the duration; the process must have no group yet."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if size < 1:
        raise ValueError(f"a simulated world needs at least one rank, got {size}")
    if dist.is_initialized():
        raise RuntimeError("a simulated world needs a process without a process group; "
                           "run it outside torchrun (or before init_distributed())")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()
