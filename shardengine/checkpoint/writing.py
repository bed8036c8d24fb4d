"""Writing a checkpoint: every rank's files into a temporary directory, then publishing it.

[Note: atomicity]
Every rank writes into ``<dir>/.tmp_step_<k>/`` and fsyncs; after all ranks
agree they are done, rank 0 writes the manifest, renames the directory to
``step_<k>``, fsyncs the parent, and only then points ``<dir>/latest`` at it
(write a temporary file, ``os.replace``). A crash anywhere before that leaves
``latest`` on the previous, complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch

from .engine_state import _records, _shared_state
from .format import FORMAT, LATEST, MANIFEST, SHARED_FILE, STEP_DIR, sha256_of
from .rng import rng_state


def choose_step(path: str, extra: Optional[dict]) -> int:
    if isinstance(extra, dict) and isinstance(extra.get("step"), int) and extra["step"] >= 0:
        return extra["step"]
    steps = [step for step, _ in _step_dirs(path)]
    return max(steps) + 1 if steps else 0


def _step_dirs(path: str) -> list[tuple[int, str]]:
    if not os.path.isdir(path):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(path) if (m := STEP_DIR.match(name))]
    return sorted(found)


def fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)  # leftovers of a save that crashed
    os.makedirs(path)


def write_rank_files(tmp_dir: str, engine, optimizer, extra: Optional[dict]) -> dict:
    """This rank's file (and rank 0's shared file); returns their manifest entries."""
    rank = engine.comm.rank
    payload = {"format": FORMAT, "rank": rank, "records": _records(engine, optimizer), "rng": rng_state()}
    name = f"rank_{rank}.pt"
    entries = {"files": {name: _write_file(payload, os.path.join(tmp_dir, name))},
               "index": {name: [[r["name"], r["start"], r["end"]] for r in payload["records"]]}}
    if rank == 0:
        shared = _shared_state(engine, optimizer, extra)
        entries["files"][SHARED_FILE] = _write_file(shared, os.path.join(tmp_dir, SHARED_FILE))
    return entries



def _write_file(obj: Any, path: str) -> dict:
    """torch.save + fsync; returns ``{"bytes", "sha256"}`` of what is on disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}



def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def publish(root: str, tmp_dir: str, final_dir: str, manifest: dict, keep: Optional[int]) -> None:
    """Rank 0: manifest, rename, ``latest``, prune; each step durable before the next."""
    manifest_path = os.path.join(tmp_dir, MANIFEST)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp_dir)
    if os.path.exists(final_dir):  # the same step saved again (e.g. after a resume)
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(root)
    pointer = os.path.join(root, LATEST)
    with open(pointer + ".tmp", "w") as f:
        f.write(os.path.basename(final_dir) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    _fsync_dir(root)
    _prune(root, os.path.basename(final_dir), keep)


def _prune(root: str, current: str, keep: Optional[int]) -> None:
    """Keep the newest ``keep`` step directories (always ``current``); drop stale temporaries."""
    for name in os.listdir(root):
        if name.startswith(".tmp_step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if keep is None:
        return
    names = [name for _, name in _step_dirs(root) if name != current]
    for name in names[:max(0, len(names) - (keep - 1))]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)

