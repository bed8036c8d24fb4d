"""Saves that the operating system refuses: run as a script, prints one JSON line.

    python save_error_cases.py DIR [--fake-enospc]

1. ENOSPC: ``DIR`` is a small tmpfs (the test mounts one in a private mount
   namespace), or, with ``--fake-enospc``, an ordinary directory where every
   write of a checkpoint file fails with ENOSPC. A first save fits; a filler
   then takes the space, so the next save fails; once the filler is gone, a
   save must succeed again.
2. EFBIG: ``RLIMIT_FSIZE`` below the size of a rank file (Python ignores
   SIGXFSZ, so the write fails with "File too large").

Each failed save must say what the OS said, leave ``latest`` on the last
good checkpoint and leave no temporary directory behind.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import sys

import torch

import shardengine as se
from shardengine.errors import CheckpointError
from shardengine.state.checkpoint import latest_checkpoint


def build():
    torch.manual_seed(0)
    net = torch.nn.Linear(256, 256)  # 256 KiB of fp32 values, 3x that with Adam's state
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage=1)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


def attempt(path: str, model, optimizer, step: int) -> dict:
    try:
        se.save_checkpoint(path, model, optimizer, extra={"step": step})
        error = None
    except CheckpointError as caught:
        error = str(caught)
    return {"error": error, "latest": os.path.basename(latest_checkpoint(path) or ""),
            "entries": sorted(os.listdir(path))}


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are used."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def full_disk(path: str, fake: bool, model, optimizer) -> dict:
    first = attempt(path, model, optimizer, 1)
    filler = os.path.join(os.path.dirname(path), "filler")
    if fake:
        import shardengine.state.checkpoint.writing as writing
        writing.open = lambda file, mode="r", *a, **k: (
            _FullDisk(open(file, mode, *a, **k), 1000) if "w" in mode and file.endswith(".pt") else
            open(file, mode, *a, **k))
    else:
        with open(filler, "wb") as f:  # take all the space that is left
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
    full = attempt(path, model, optimizer, 2)
    if fake:
        del writing.open
    else:
        os.remove(filler)
    return {"first": first, "full": full, "after": attempt(path, model, optimizer, 3)}


def file_too_large(path: str, model, optimizer) -> dict:
    resource.setrlimit(resource.RLIMIT_FSIZE, (128 * 1024, resource.RLIM_INFINITY))
    return attempt(path, model, optimizer, 1)


def main() -> None:
    work, fake = sys.argv[1], "--fake-enospc" in sys.argv
    model, optimizer = build()
    results = {"enospc": full_disk(os.path.join(work, "ckpt"), fake, model, optimizer)}
    results["efbig"] = file_too_large(os.path.join(work, "ckpt_efbig"), model, optimizer)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
