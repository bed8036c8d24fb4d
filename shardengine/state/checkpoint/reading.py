"""Reading a checkpoint: finding it, verifying its files, and reading element ranges by name.

Nothing here writes to the model: the reader returns new tensors, so a load
can check everything before it changes anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .format import (DATA_FILE, FORMAT, FORMATS, LATEST, MANIFEST, OLD_PREFIX, PUBLISHED_DIR, SHARED_FILE, TMP_PREFIX,
                     buffer_entries, check_inside, latest_target, optimizer_class_name, read_json, sha256_of)
from .index import LayoutIndex, ManifestIndex
from ...errors import CheckpointError


def latest_checkpoint(path: str) -> Optional[str]:
    """The step directory ``path/latest`` points at, or None when there is none yet.

    Raises :class:`CheckpointError` if ``latest`` names anything but a step
    directory inside ``path`` (``../``, an absolute path, a symbolic link out).

    >>> latest_checkpoint("/nonexistent") is None
    True
    """
    target = latest_target(path)
    if target is None:
        return None
    if not PUBLISHED_DIR.match(target):
        raise CheckpointError(f"{os.path.join(path, LATEST)} holds {target!r}, which is not the name of a "
                              f"step directory (step_<k>) inside {path}; refusing to follow it")
    step_dir = os.path.join(path, target)
    check_inside(step_dir, path, "this step directory is a symbolic link that")
    return step_dir


def resolve_checkpoint(path: str) -> str:
    """The step directory to read for ``path`` (a step directory, or a directory with ``latest``)."""
    if os.path.basename(os.path.normpath(path)).startswith((TMP_PREFIX, OLD_PREFIX)):
        raise CheckpointError(f"{path} is what an interrupted or replaced save left behind, not a "
                              f"published checkpoint; load its parent directory (its '{LATEST}')")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    step_dir = latest_checkpoint(path)
    if step_dir is None:
        raise CheckpointError(f"no checkpoint at {path}: neither {MANIFEST} nor a '{LATEST}' pointer")
    if not os.path.isfile(os.path.join(step_dir, MANIFEST)):
        raise CheckpointError(f"{os.path.join(path, LATEST)} points at {step_dir}, which has no {MANIFEST}")
    return step_dir


class CheckpointReader:
    """Verified, lazy access to one step directory's files, by parameter name and range.

    Files are checked (size, sha256) when first needed and memory-mapped, so a
    reader holds little beyond what the caller copies out.
    """

    def __init__(self, step_dir: str):
        self.step_dir = step_dir
        self.manifest = read_manifest(step_dir)
        self.index = (LayoutIndex(self.manifest) if self.manifest["format"] == FORMAT
                      else ManifestIndex(self.manifest))  # see index.py
        for file in self.index.listed_files():
            if not isinstance(file, str) or not DATA_FILE.match(file):
                raise CheckpointError(f"{os.path.join(step_dir, MANIFEST)}: lists a file {file!r}; a "
                                      "checkpoint's files are rank_<r>.pt and shared.pt in its directory")
        self.params = {p["name"]: p for p in self.manifest["params"]}
        self._loaded: dict[str, dict] = {}
        self._records: dict[str, dict[tuple[str, int], dict]] = {}

    # -- files

    def path(self, file: str) -> str:
        return os.path.join(self.step_dir, file)

    def record_files(self) -> list[str]:
        """The rank files that hold records, in rank order."""
        return self.index.record_files()

    def has_rank_file(self, rank: int) -> bool:
        """Whether rank ``rank`` of the saving run wrote a file (its RNG state)."""
        return self.index.has_rank_file(rank)

    def check_present(self) -> None:
        """Every file that holds records exists with its recorded size (cheap: no hashing)."""
        for file in [SHARED_FILE] + self.record_files():
            _check_size(self.path(file), self._info(file)["bytes"])

    def verify(self, file: str) -> None:
        info = self._info(file)
        path = self.path(file)
        check_inside(path, self.step_dir, "this file is a symbolic link that")
        _check_size(path, info["bytes"])
        actual = sha256_of(path)
        if actual != info["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch (file {actual[:16]}..., recorded "
                                  f"{info['sha256'][:16]}...): the file is corrupt")

    def _info(self, file: str) -> dict:
        info = self.index.file_info(file, self.step_dir)
        if info is None:
            raise CheckpointError(f"{self.path(file)}: not part of this checkpoint ({MANIFEST})")
        return info

    def load(self, file: str) -> dict:
        """The verified contents of ``file``: tensors and plain data only (``weights_only``)."""
        if file not in self._loaded:
            self.verify(file)
            try:
                self._loaded[file] = torch.load(self.path(file), map_location="cpu", mmap=True,
                                                weights_only=True)
            except Exception as error:  # noqa: BLE001 - name the file whatever went wrong
                raise CheckpointError(f"{self.path(file)}: cannot be read ({error})") from error
        return self._loaded[file]

    def release(self, file: str) -> None:
        """Forget ``file``'s contents (unmaps it once the caller drops its tensors)."""
        self._loaded.pop(file, None)
        self._records.pop(file, None)

    def records(self, file: str) -> dict[tuple[str, int], dict]:
        """``(name, start) -> record`` of a rank file."""
        if file not in self._records:
            self._records[file] = {(r["name"], r["start"]): r for r in self.load(file)["records"]}
        return self._records[file]

    # -- ranges

    def pieces(self, name: str, lo: int, hi: int) -> list[tuple[int, int, dict]]:
        """``(a, b, record)`` covering elements ``[lo, hi)`` of parameter ``name``, in order."""
        found = []
        for start, end, file in self.index.pieces(name):
            if start < hi and lo < end:
                found.append((max(start, lo), min(end, hi), start, file))
        covered = lo
        for a, b, _, _ in found:
            if a > covered:
                break
            covered = max(covered, b)
        if covered < hi:
            raise CheckpointError(f"{self.step_dir}: elements [{covered}, {hi}) of {name} are in "
                                  f"no file of the checkpoint (the index in {MANIFEST} is incomplete)")
        return [(a, b, self._record(file, name, start)) for a, b, start, file in found]

    def _record(self, file: str, name: str, start: int) -> dict:
        record = self.records(file).get((name, start))
        if record is None:
            raise CheckpointError(f"{self.path(file)}: has no record {name}[{start}:] listed in {MANIFEST}")
        return record


def read_manifest(step_dir: str) -> dict:
    path = os.path.join(step_dir, MANIFEST)
    check_inside(path, step_dir, "the manifest is a symbolic link that")
    manifest = read_json(path, "not a complete checkpoint")
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: format {found!r}, expected {FORMAT!r} (or an earlier one: {FORMATS[:-1]})")
    return manifest


def _check_size(path: str, expected: int) -> None:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (the manifest lists it; was a rank's file lost?)")
    actual = os.path.getsize(path)
    if actual != expected:
        kind = "truncated" if actual < expected else "longer than recorded"
        raise CheckpointError(f"{path}: {kind}: {actual} bytes, {expected} recorded")


def check_same_model(reader: CheckpointReader, engine, optimizer) -> None:
    """Same parameter names and shapes, buffers, optimizer class and group count, or a clear error."""
    where = reader.path(MANIFEST)
    saved = {name: tuple(p["shape"]) for name, p in reader.params.items()}
    current = {name: tuple(p.shape) for name, p in engine.module.named_parameters()}
    problems = [f"{name} is missing from the model" for name in saved if name not in current]
    problems += [f"the model's {name} is not in the checkpoint" for name in current if name not in saved]
    problems += [f"{name} has shape {list(saved[name])} in the checkpoint, {list(shape)} in the model"
                 for name, shape in current.items() if name in saved and saved[name] != shape]
    saved_buffers = set(reader.manifest["buffers"])
    current_buffers = {k for k, v in buffer_entries(engine.module).items() if torch.is_tensor(v)}
    problems += [f"buffer {key} differs" for key in sorted(saved_buffers ^ current_buffers)]
    saved_opt = reader.manifest["optimizer"]
    if saved_opt["class"] != optimizer_class_name(optimizer):
        problems.append(f"optimizer is {saved_opt['class']} in the checkpoint, "
                        f"{optimizer_class_name(optimizer)} now")
    if saved_opt["param_groups"] != len(optimizer.param_groups):
        problems.append(f"optimizer has {saved_opt['param_groups']} param groups in the checkpoint, "
                        f"{len(optimizer.param_groups)} now")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"{where}: the checkpoint is of a different model layout: {shown}")


def read_range(reader: CheckpointReader, name: str, lo: int, hi: int, key: str) -> torch.Tensor:
    pieces = reader.pieces(name, lo, hi)
    first = pieces[0][2][key] if pieces else torch.zeros(0)
    out = torch.empty(hi - lo, dtype=first.dtype)
    for a, b, record in pieces:
        out[a - lo:b - lo] = record[key][a - record["start"]:b - record["start"]]
    return out


@dataclass
class StatePart:
    """Optimizer state of a range of elements: per-element tensors (1-D) and scalars (``step``)."""

    elementwise: dict[str, torch.Tensor]
    scalars: dict[str, Any]

    def as_state(self, shape: Optional[torch.Size] = None) -> dict:
        """An ``optimizer.state`` entry; element-wise tensors reshaped to ``shape`` if given."""
        tensors = {k: v.reshape(shape) if shape is not None else v for k, v in self.elementwise.items()}
        scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.scalars.items()}
        return {**scalars, **tensors}


def read_state(reader: CheckpointReader, name: str, lo: int, hi: int) -> Optional[StatePart]:
    """Optimizer state of elements ``[lo, hi)`` of ``name``.

    None when no piece has state (saved before the first step). A piece
    without an entry another piece has (never stepped) contributes zeros.
    """
    pieces = [(a, b, r) for a, b, r in reader.pieces(name, lo, hi) if r.get("state") or r.get("scalars")]
    if not pieces:
        return None
    dtypes = {key: r["state"][key].dtype for _, _, r in pieces for key in r["state"]}
    elementwise = {key: torch.zeros(hi - lo, dtype=dtype) for key, dtype in dtypes.items()}
    for a, b, record in pieces:
        for key, value in record["state"].items():
            elementwise[key][a - lo:b - lo] = value[a - record["start"]:b - record["start"]]
    return StatePart(elementwise, dict(pieces[0][2]["scalars"]))

