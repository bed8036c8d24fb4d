"""One training step timed between two barriers: the slowest rank's time (benchmarks share it)."""
from __future__ import annotations

import time
from typing import Callable


def timed_step(model, optimizer, ids, targets, loss_fn: Callable) -> float:
    """Seconds for forward, backward, ``optimizer.step()`` and ``zero_grad()``, between barriers."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss_fn(model(ids), targets).backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return time.perf_counter() - start
