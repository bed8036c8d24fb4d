"""Writing a checkpoint: every rank's files into a temporary directory, then publishing it.

[Note: atomicity]
Every rank writes into ``<dir>/.tmp_step_<k>/`` and fsyncs; after all ranks
agree they are done, rank 0 writes the manifest, renames the directory to
``step_<k>``, fsyncs the parent, and only then points ``<dir>/latest`` at it
(write a temporary file, ``os.replace``). Each of these is durable before the
next begins, so a crash at any instant leaves ``latest`` naming a complete
checkpoint: the previous one, or the new one.

Saving step k again while ``latest`` names ``step_<k>`` (after a resume) must
not delete the only published checkpoint before its replacement is in place.
So the old one is first kept published under a second name:
``step_<k>.previous`` gets a hard link to each of its files (files are never
modified in place, only replaced; each rank links its own), ``latest`` is
pointed there, and only then is ``step_<k>`` moved aside (``.old_step_<k>``)
and replaced.

What a save replaces or prunes is only *renamed* by rank 0 (``.old_*``, one
rename per directory); each rank then deletes its own files there and rank 0
the rest, so rank 0 does not unlink N files per save. Directories a crash may
leave behind (``.tmp_step_*``, ``.old_*``, a ``step_*.previous`` that ``latest``
no longer names) are removed by rank 0 at the start of the next save, and when
a save fails, so a full disk does not stay full of dead checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from typing import Any, Callable, Iterator, Optional

import torch

from .engine_state import _records, _shared_state
from .format import (FORMAT, LATEST, MANIFEST, OLD_PREFIX, PREVIOUS_SUFFIX, SHARED_FILE, STEP_DIR, TMP_PREFIX,
                     check_plain_data, latest_target, sha256_of)
from .index import RANK_FILE, SIDECAR
from .rng import rng_state

# Fault-injection seam: called with the name of each point a save passes (tests
# kill the process there). None in normal use.
on_point: Optional[Callable[[str], None]] = None


def _reached(point: str) -> None:
    if on_point is not None:
        on_point(point)


# =========================================================================== before writing (rank 0)


def prepare_save(path: str, extra: Optional[dict]) -> tuple[int, bool]:
    """Rank 0: check ``extra``, clean a crashed save's leftovers, create the temporary directory.

    Returns the step to save, and whether it replaces the published one (``latest`` names
    ``step_<k>``): then ``step_<k>.previous`` is created for every rank to link its files into.
    """
    check_plain_data(extra, "extra")
    os.makedirs(path, exist_ok=True)
    clean_leftovers(path)
    step = choose_step(path, extra)
    os.makedirs(os.path.join(path, f"{TMP_PREFIX}step_{step}"))
    name = f"step_{step}"
    holds = os.path.isdir(os.path.join(path, name)) and latest_target(path) == name
    if holds:
        os.mkdir(os.path.join(path, name + PREVIOUS_SUFFIX))
    return step, holds


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


def clean_leftovers(root: str) -> None:
    """Remove what interrupted saves left in ``root``; never what ``latest`` names."""
    named = latest_target(root)
    for name in os.listdir(root):
        leftover = (name.startswith((TMP_PREFIX, OLD_PREFIX)) or name == LATEST + ".tmp"
                    or name.endswith(PREVIOUS_SUFFIX) and name != named)
        if leftover:
            _remove(os.path.join(root, name))


def discard_temporary(tmp_dir: str) -> None:
    """After a failed save: free the space its files took (best effort; the next save retries)."""
    try:
        _remove(tmp_dir)
    except OSError:
        pass


# =========================================================================== rank files


def write_rank_files(tmp_dir: str, engine, optimizer, extra: Optional[dict]) -> Optional[dict]:
    """This rank's file and its sidecar (index.py), and rank 0's shared file: returns the shared
    file's ``{"bytes", "sha256"}`` on rank 0 (for the manifest), None elsewhere."""
    rank = engine.comm.rank
    payload = {"format": FORMAT, "rank": rank, "records": _records(engine, optimizer), "rng": rng_state(),
               # what compressed communication carries between steps (distributed/compression/collectives.py)
               "compression": engine.compression.state_dict() if engine.compression is not None else None}
    info = _write_file(payload, os.path.join(tmp_dir, RANK_FILE.format(rank)))
    index = [[r["name"], r["start"], r["end"]] for r in payload["records"]]
    _write_text(os.path.join(tmp_dir, SIDECAR.format(rank)), json.dumps({"format": FORMAT, "rank": rank, **info,
                                                                        "index": index}))
    if rank == 0:
        return _write_file(_shared_state(engine, optimizer, extra), os.path.join(tmp_dir, SHARED_FILE))
    return None


def hold_own_files(root: str, name: str, rank: int) -> None:
    """Re-saving the published ``name``: link this rank's files into ``name.previous`` (rank 0:
    the manifest and shared file too), which ``publish`` then points ``latest`` at."""
    files = [RANK_FILE.format(rank), SIDECAR.format(rank)] + ([MANIFEST, SHARED_FILE] if rank == 0 else [])
    for file in files:
        source = os.path.join(root, name, file)
        if os.path.exists(source):  # a format-1 checkpoint has no sidecars
            _link_or_copy(source, os.path.join(root, name + PREVIOUS_SUFFIX, file))
            _reached("linked a file")


class _RecordingWriter:
    """A file's ``write`` that remembers the OS error, which torch.save replaces by its own
    ("[enforce fail at inline_container.cc] unexpected pos ...")."""

    def __init__(self, file):
        self.file = file
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def _write_file(obj: Any, path: str) -> dict:
    """torch.save + fsync; returns ``{"bytes", "sha256"}`` of what is on disk."""
    with _naming_os_errors(path):
        with open(path, "wb") as f:
            writer = _RecordingWriter(f)
            try:
                torch.save(obj, writer)
            except Exception as error:  # noqa: BLE001 - the OS error, if one caused it, says more
                if writer.error is not None:
                    raise writer.error from error
                raise
            _reached("file written")
            f.flush()
            os.fsync(f.fileno())
        _reached("file synced")
        return {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}


@contextlib.contextmanager
def _naming_os_errors(path: str) -> Iterator[None]:
    """Re-raise an OSError that names no file (write, flush, fsync) with ``path`` in it."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno is not None:
            raise OSError(error.errno, os.strerror(error.errno), path) from error
        raise


def _write_text(path: str, text: str) -> None:
    with _naming_os_errors(path):
        with open(path, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# =========================================================================== publishing (rank 0)


def publish(root: str, tmp_dir: str, final_dir: str, manifest: dict, keep: Optional[int], holds: bool) -> list[str]:
    """Rank 0: manifest, rename, ``latest``; each step durable before the next. Returns the
    directories set aside to delete (the replaced one, the pruned ones; see ``remove_set_aside``)."""
    _write_text(os.path.join(tmp_dir, MANIFEST), json.dumps(manifest, indent=1))
    _fsync_dir(tmp_dir)
    _reached("manifest written")
    name = os.path.basename(final_dir)
    aside = []
    if holds:  # every rank linked its files into name.previous (hold_own_files)
        _fsync_dir(os.path.join(root, name + PREVIOUS_SUFFIX))
        _fsync_dir(root)
        _point_latest(root, name + PREVIOUS_SUFFIX)
    if os.path.exists(final_dir):  # the same step saved again (e.g. after a resume)
        aside.append(_move_aside(root, name))
    os.rename(tmp_dir, final_dir)
    _fsync_dir(root)
    _reached("renamed")
    held = latest_target(root)  # a held copy (this save's, or one a crashed re-save left named)
    _point_latest(root, name)
    if held is not None and held.endswith(PREVIOUS_SUFFIX) and os.path.isdir(os.path.join(root, held)):
        aside.append(_move_aside(root, held))
    return aside + _prune(root, name, keep)


def remove_set_aside(root: str, aside: list[str], rank: int) -> None:
    """Every rank: delete its own files from the directories ``publish`` set aside."""
    for folder in aside:
        for file in (RANK_FILE.format(rank), SIDECAR.format(rank)):
            path = os.path.join(root, folder, file)
            if os.path.exists(path):
                os.remove(path)
                _reached("removed a file")


def remove_directories(root: str, aside: list[str]) -> None:
    """Rank 0, after every rank removed its own files: what is left (manifest, shared file)."""
    for folder in aside:
        _remove(os.path.join(root, folder))


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError as error:  # a file system without hard links: copy (slower, same result)
        if error.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copyfile(source, target)
        with open(target, "rb") as f:
            os.fsync(f.fileno())


def _move_aside(root: str, name: str) -> str:
    """Rename ``name`` out of the published names (one rename, durable); deleted afterwards."""
    aside = OLD_PREFIX + name
    _remove(os.path.join(root, aside))
    os.rename(os.path.join(root, name), os.path.join(root, aside))
    _fsync_dir(root)
    _reached("moved aside")
    return aside


def _point_latest(root: str, name: str) -> None:
    pointer = os.path.join(root, LATEST)
    _write_text(pointer + ".tmp", name + "\n")
    os.replace(pointer + ".tmp", pointer)
    _fsync_dir(root)
    _reached(f"latest -> {name}")


def _prune(root: str, current: str, keep: Optional[int]) -> list[str]:
    """Set aside all but the newest ``keep`` step directories (always ``current``)."""
    if keep is None:
        return []
    names = [name for _, name in _step_dirs(root) if name != current]
    return [_move_aside(root, name) for name in names[:max(0, len(names) - (keep - 1))]]


def _remove(path: str) -> None:
    """Delete a file or directory tree (a named point per file, for the fault tests)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
        return
    if not os.path.isdir(path):
        return
    for entry in os.listdir(path):
        _remove(os.path.join(path, entry))
        _reached("removed a file")
    os.rmdir(path)
