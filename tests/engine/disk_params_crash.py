"""Kill a run whose parameters and optimizer state are on disk, mid-step; a resume must read
nothing of it but its last checkpoint.

Run as a script by test_disk_params.py: ``disk_params_crash.py PATH CHECKPOINT RECORD POINT``.
One process (a one-rank group) trains stage 3 with ``offload_params="disk"`` files under
PATH, saves CHECKPOINT after two steps and records its weights in RECORD, then SIGKILLs
itself in the third step at POINT: "forward" (a unit's shard being read ahead) or "step"
(between the optimizer's write-behinds, offload/disk_tier.py).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

import shardengine as se
from disk_offload_cases import _train
from param_offload_cases import _shard


def _kill_in_forward(model, optimizer) -> None:
    model.engine.layout.units[1].module.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))


def _kill_in_step(model, optimizer) -> None:
    """Once the step starts, die after the second bucket's write-behind."""
    files, released = model.engine.disk.files, []
    release = files.release

    def release_then_die(tensor: torch.Tensor) -> None:
        release(tensor)
        released.append(tensor)
        if len(released) == 2 * 2:  # a bucket writes its master and Adam's two moments: into the 2nd
            os.kill(os.getpid(), signal.SIGKILL)

    def arm(*_) -> None:
        files.release = release_then_die
    optimizer.register_step_pre_hook(arm)


def main(path: str, checkpoint: str, record: str, point: str) -> None:
    store = dist.FileStore(os.path.join(os.path.dirname(record), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model, optimizer = _shard({"offload_params": "disk", "offload_path": path}, frozen=True)
    _train(model, optimizer, steps=2)
    se.save_checkpoint(checkpoint, model, optimizer)
    torch.save(model.full_state_dict(), record)
    (_kill_in_forward if point == "forward" else _kill_in_step)(model, optimizer)
    _train(model, optimizer, steps=1, seed=2)
    raise SystemExit("the third step finished: no kill happened")


if __name__ == "__main__":
    main(*sys.argv[1:5])
