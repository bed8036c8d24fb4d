"""``torch.compile`` on a sharded model: the engine's hooks run eagerly, outside dynamo.

[Note: engine hooks are graph breaks]
The engine's module hooks (the root's forward pre/post hooks, stage 3's per-unit
gather/free hooks) read parameters, talk to the other ranks, count micro-steps
and register autograd hooks. Traced by dynamo they would (a) read stage-3
parameters while they are sharded (the guard in flat/guard.py raises), (b) be
replayed from a graph with their Python side effects (counters, batch weights,
collectives) guarded on or baked in, which is a silent wrong number waiting for
a change of input. So every hook is wrapped in :func:`torch._dynamo.disable`:
dynamo breaks the graph at each hook call, the hook runs eagerly, and the
module code between hooks (a block's forward, with its parameters gathered) is
compiled. FSDP2 does the same for its hooks. The cost is one break per hook call
(measured per stage in docs/compile-and-trainable-set.md); compiling each block
before ``shard()`` (torchtitan's order) puts the hooks outside the compiled
frames altogether.

Autograd hooks (post-accumulate-grad, output-gradient hooks) run in the autograd
engine, which dynamo does not trace without compiled autograd: they need nothing.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_hook(fn: F) -> F:
    """``fn`` run eagerly even when called from a frame ``torch.compile`` traces."""
    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    if disable is None:
        return fn
    return functools.wraps(fn)(disable(fn, recursive=True))
