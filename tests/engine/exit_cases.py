"""Run under torchrun: does ``destroy_process_group()`` free every process group?

Trains TinyNet at stage 3 with ``timeout_s`` (so the engine has a group of its
own besides the default one), saves a checkpoint and gathers the full state,
then destroys the process group *while the model is still alive* and reports,
per rank, whether each group object was freed, and if not, which functions'
default arguments hold it. A group that outlives destroy keeps its Gloo
threads running into interpreter exit, where one of them can abort the process
(see shardengine/distributed/launch.py, [Note: the default group at exit]).

    python -m torch.distributed.run --nproc_per_node=2 tests/engine/exit_cases.py OUT_DIR
"""

from __future__ import annotations

import gc
import json
import os
import sys
import types
import weakref

import shardengine as se  # first: a training script imports its libraries before creating the group
import torch
import torch.distributed as dist

import checkpoint_cases as cases


def holders(obj) -> list[str]:
    """Functions whose default arguments hold ``obj``."""
    found = []
    for candidate in gc.get_objects():
        if isinstance(candidate, types.FunctionType):
            defaults = (candidate.__defaults__ or ()) + tuple((candidate.__kwdefaults__ or {}).values())
            if any(d is obj for d in defaults):
                found.append(f"{candidate.__module__}.{candidate.__qualname__}")
    return found


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    info = se.init_distributed(timeout_s=30)
    model, optimizer = cases.build(3, timeout_s=20)
    cases.train(model, optimizer, 2)
    se.save_checkpoint(os.path.join(out_dir, "ckpt"), model, optimizer, extra={"step": 2})
    model.full_state_dict()
    world, engine_group = dist.group.WORLD, model.engine.comm.world.group
    report = {"world_held_by": holders(world), "engine_group_held_by": holders(engine_group)}
    world, engine_group = weakref.ref(world), weakref.ref(engine_group)
    dist.destroy_process_group()
    report.update(world_freed=world() is None, engine_group_freed=engine_group() is None)
    with open(os.path.join(out_dir, f"rank_{info.rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
