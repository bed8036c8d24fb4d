"""Weight files as Hugging Face writes them: find and verify them, read element ranges, write them.

Reading (:class:`WeightFiles`): a directory holding ``model.safetensors``,
``model.safetensors.index.json`` (sharded), ``pytorch_model.bin`` or
``pytorch_model.bin.index.json``, or one such file (any ``*.safetensors``,
any ``torch.save`` state dict, any index). Everything checkable without the
data is checked when it is opened: every file the index names exists, every
header is complete (a truncated safetensors file fails here), every tensor
the index assigns to a file is in it. Then :meth:`WeightFiles.read` returns
elements ``[lo, hi)`` of one flattened tensor, touching only those bytes:
safetensors files are memory-mapped per read (``safe_open(...).get_slice``,
rows of the first dimension, trimmed), so no mapping outlives the read; torch
files are memory-mapped one file at a time (``torch.load(mmap=True)``).

Writing (:class:`SafetensorsWriter`): the header is known before any data
(names, dtypes, shapes), so it is written first and each tensor's bytes go to
their offset whenever they are ready, in any order: a sharded model streams
out one gathered unit at a time. Files are named and indexed as
``save_pretrained`` names them (``model.safetensors``, or
``model-00001-of-0000n.safetensors`` + ``model.safetensors.index.json``).

>>> plan_files([("a", torch.float32, (4,)), ("b", torch.float32, (2, 3))], max_file_bytes=20)
[[('a', torch.float32, (4,))], [('b', torch.float32, (2, 3))]]
>>> file_names(2)
['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ...errors import CheckpointError

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_SINGLE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
SEARCH_ORDER = (SAFE_INDEX, SAFE_SINGLE, TORCH_INDEX, TORCH_SINGLE)

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPE_OF_CODE = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
for _dtype, _code in ((getattr(torch, "uint16", None), "U16"), (getattr(torch, "uint32", None), "U32"),
                      (getattr(torch, "uint64", None), "U64")):
    if _dtype is not None:
        SAFETENSORS_DTYPES[_dtype], DTYPE_OF_CODE[_code] = _code, _dtype

Entry = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives, and what it is."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# =========================================================================== reading


class WeightFiles:
    """The tensors of a checkpoint by name, verified; element ranges read on demand."""

    def __init__(self, path: str):
        self.path = path
        files, assigned = locate(path)
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            header = _read_header(file)
            wanted = assigned.get(file) if assigned is not None else list(header)
            absent = [name for name in wanted if name not in header]
            if absent:
                raise CheckpointError(f"{file}: the index lists {_few(absent)} in this file, "
                                      "but it does not hold them")
            for name in wanted:
                self.tensors[name] = header[name]
        self._torch_file: Optional[tuple[str, dict]] = None

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` flattened, in its stored dtype."""
        info = self.tensors[name]
        if _is_safetensors(info.file):
            from safetensors import safe_open
            with safe_open(info.file, framework="pt") as f:
                if len(info.shape) == 0:
                    return f.get_tensor(name).reshape(-1)[lo:hi]
                return _rows_then_trim(f.get_slice(name), info.shape, lo, hi)
        return self._torch_state(info.file)[name].reshape(-1)[lo:hi]

    def read_order(self, name: str) -> tuple[int, str]:
        """Sort key that keeps reads from one torch file together (one mapping at a time)."""
        return self.files.index(self.tensors[name].file), name

    def release(self) -> None:
        """Drop the memory-mapped torch file, if one is open."""
        self._torch_file = None

    def _torch_state(self, file: str) -> dict:
        if self._torch_file is None or self._torch_file[0] != file:
            self._torch_file = None  # unmap the previous file first
            self._torch_file = (file, _load_torch_state(file))
        return self._torch_file[1]


def locate(path: str) -> tuple[list[str], Optional[dict[str, list[str]]]]:
    """The weight files of ``path`` and, for an index, which tensors each one holds."""
    if os.path.isdir(path):
        for name in SEARCH_ORDER:
            if os.path.isfile(os.path.join(path, name)):
                return locate(os.path.join(path, name))
        raise CheckpointError(f"{path}: no weights found (looked for {', '.join(SEARCH_ORDER)})")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.endswith(".json"):
        return [path], None
    weight_map = _read_index(path)
    folder = os.path.dirname(path)
    assigned: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        assigned.setdefault(os.path.join(folder, file), []).append(name)
    missing = [f"{os.path.basename(f)} ({len(names)} tensors, e.g. {names[0]})"
               for f, names in assigned.items() if not os.path.isfile(f)]
    if missing:
        raise CheckpointError(f"{path}: weight file(s) missing from {folder}: {_few(missing)}")
    return list(assigned), assigned


def _read_index(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            index = json.load(f)
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}: not a readable weight index ({type(error).__name__}: {error})") from error
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to file names")
    return weight_map


def _is_safetensors(file: str) -> bool:
    return file.endswith(".safetensors")


def _read_header(file: str) -> dict[str, TensorInfo]:
    if _is_safetensors(file):
        return _safetensors_header(file)
    return {name: TensorInfo(file, t.dtype, tuple(t.shape)) for name, t in _load_torch_state(file).items()}


def _safetensors_header(file: str) -> dict[str, TensorInfo]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(f"{file}: reading safetensors needs the safetensors package "
                              "(pip install 'shardengine[hf]')") from None
    try:
        with safe_open(file, framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            codes = {name: s.get_dtype() for name, s in slices.items()}
            shapes = {name: tuple(s.get_shape()) for name, s in slices.items()}
    except Exception as error:  # noqa: BLE001 - SafetensorError and OSError alike: name the file
        raise CheckpointError(f"{file}: not a complete safetensors file ({error})") from error
    unknown = sorted({code for code in codes.values() if code not in DTYPE_OF_CODE})
    if unknown:
        raise CheckpointError(f"{file}: tensors of dtype {unknown}, which torch cannot hold here")
    return {name: TensorInfo(file, DTYPE_OF_CODE[codes[name]], shapes[name]) for name in codes}


def _load_torch_state(file: str) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated zip, legacy format, not a torch file
        raise CheckpointError(f"{file}: cannot be memory-mapped as a torch state dict ({error}); "
                              "files written by torch.save (zip format) or safetensors can") from error
    state = loaded
    for nested in ("state_dict", "model"):  # common wrappers of a state dict
        if isinstance(state, dict) and isinstance(state.get(nested), dict):
            state = state[nested]
    if not isinstance(state, dict) or not any(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"{file}: holds {type(loaded).__name__}, not a state dict of tensors")
    return {name: value for name, value in state.items() if torch.is_tensor(value)}


def _rows_then_trim(stored, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Flat ``[lo, hi)`` of an n-d tensor read as whole rows of its first dimension, then trimmed."""
    row = math.prod(shape[1:])
    if row == 0 or hi <= lo:
        return torch.empty(0, dtype=DTYPE_OF_CODE[stored.get_dtype()])
    first, last = lo // row, -(-hi // row)
    rows = stored[first:last].reshape(-1)
    return rows[lo - first * row:hi - first * row]


# =========================================================================== writing


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``size``: an int, or "5GB" / "500MB" / "2GiB" (as ``save_pretrained`` reads it).

    >>> parse_size("5GB"), parse_size("1KiB"), parse_size(7)
    (5000000000, 1024, 7)
    """
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(size), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size must be a positive int or like '5GB' / '500MB', got {size!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


def entry_bytes(entry: Entry) -> int:
    return math.prod(entry[2]) * entry[1].itemsize


def plan_files(entries: list[Entry], max_file_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most ``max_file_bytes`` (a larger
    tensor gets a file of its own); at least one file."""
    files: list[list[Entry]] = [[]]
    filled = 0
    for entry in entries:
        size = entry_bytes(entry)
        if files[-1] and filled + size > max_file_bytes:
            files.append([])
            filled = 0
        files[-1].append(entry)
        filled += size
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(folder: str, weight_map: dict[str, str], entries: list[Entry]) -> str:
    """``model.safetensors.index.json`` for a sharded save; returns its path."""
    index = {"metadata": {"total_size": sum(entry_bytes(e) for e in entries),
                          "total_parameters": sum(math.prod(e[2]) for e in entries)},
             "weight_map": dict(sorted(weight_map.items()))}
    path = os.path.join(folder, SAFE_INDEX)
    write_json_atomically(path, index)
    return path


def write_json_atomically(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def encode_header(entries: list[Entry], metadata: Optional[dict[str, str]] = None) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``entries`` (in that order), padded so the data starts
    8-byte aligned, and each tensor's offset within the data."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offsets, offset = {}, 0
    for name, dtype, shape in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {dtype} has no safetensors code")
        size = entry_bytes((name, dtype, shape))
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offsets[name] = offset
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % 8)
    return len(encoded).to_bytes(8, "little") + encoded, offsets


def file_bytes(entries: list[Entry], metadata: Optional[dict[str, str]] = None) -> int:
    """The size of the safetensors file :class:`SafetensorsWriter` writes for ``entries``."""
    return len(encode_header(entries, metadata)[0]) + sum(entry_bytes(e) for e in entries)


class SafetensorsWriter:
    """One safetensors file whose tensors arrive in any order; :meth:`close` checks all came."""

    def __init__(self, path: str, entries: list[Entry], metadata: Optional[dict[str, str]] = None):
        if sys.byteorder != "little":
            raise CheckpointError("safetensors files are little-endian; this machine is not")
        header, offsets = encode_header(entries, metadata)
        self._where = {name: (offsets[name], dtype, tuple(shape)) for name, dtype, shape in entries}
        self.path = path
        self.nbytes = len(header) + sum(entry_bytes(e) for e in entries)
        self._data_start = len(header)
        self._pending = set(self._where)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(self._fd, header, 0)
        os.ftruncate(self._fd, self.nbytes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, dtype, shape = self._where[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(f"{self.path}: {name} is {tensor.dtype} {list(tensor.shape)}, "
                                  f"the header says {dtype} {list(shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        _write_all(self._fd, memoryview(data.numpy()), self._data_start + offset)
        self._pending.discard(name)

    def close(self) -> None:
        """Flush to disk; a tensor never written is an error (its bytes would be zeros)."""
        try:
            if self._pending:
                raise CheckpointError(f"{self.path}: never received {_few(sorted(self._pending))}")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        os.close(self._fd)
        os.remove(self.path)


def _write_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _few(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def write_folder(state: dict[str, torch.Tensor], folder: str, max_file_bytes: int) -> list[str]:
    """A whole in-memory state dict as ``save_pretrained`` lays it out; a tensor shared by
    several keys (tied weights) is written once, under its first key. Returns the files."""
    os.makedirs(folder, exist_ok=True)
    first_key: dict[int, str] = {}
    for key, tensor in state.items():
        first_key.setdefault(id(tensor), key)
    kept = {key: state[key] for key in first_key.values()}
    entries = [(key, t.dtype, tuple(t.shape)) for key, t in kept.items()]
    files = plan_files(entries, max_file_bytes)
    names = file_names(len(files))
    for name, file_entries in zip(names, files):
        writer = SafetensorsWriter(os.path.join(folder, name), file_entries)
        for key, _, _ in file_entries:
            writer.write(key, kept[key])
        writer.close()
    written = [os.path.join(folder, name) for name in names]
    if len(files) > 1:
        weight_map = {entry[0]: name for name, file_entries in zip(names, files) for entry in file_entries}
        written.append(write_index(folder, weight_map, entries))
    return written
