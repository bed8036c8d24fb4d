"""Sharded, atomic, reshardable checkpoints: ``save_checkpoint`` / ``load_checkpoint``.

[Note: the universal format]
A checkpoint is keyed by *parameter name and element range*, not by rank or
flat-buffer offset. Rank r writes, for every flat bucket, the fragments of
its owned range (``layout.fragments(r)``): ``(name, start, end)`` within the
flattened parameter, the fp32 training values there (the master when there
is one) and the matching slice of every element-wise optimizer state tensor
(under hybrid sharding only the first shard group writes: the others are
replicas of it). Scalar states (``step``) travel with each fragment. Loading
at any world size M and stage t, hybrid or not, is then just reading ranges:
each rank asks for the ranges it holds in the *new* layout, and the
manifest's index says which files hold them. Element-wise optimizers only
(the engine refuses others at stages >= 1), so slicing and re-joining state
is exact.

[Note: atomicity]
Every rank writes into ``<dir>/.tmp_step_<k>/`` and fsyncs; after all ranks
agree they are done, rank 0 writes the manifest, renames the directory to
``step_<k>``, fsyncs the parent, and only then points ``<dir>/latest`` at it
(write a temporary file, ``os.replace``). A crash anywhere before that leaves
``latest`` on the previous, complete checkpoint.

[Note: nothing loads partially]
Loading reads and verifies everything first (manifest, layout, sizes,
sha256) into new tensors, then the ranks agree (``all_gather_object``) that
every one of them succeeded, and only then are the model, the optimizer and
the RNGs written. Errors are raised on every rank, so no rank is left waiting
in a collective.

Layout of a checkpoint directory::

    ckpt/latest                 "step_200"
    ckpt/step_200/manifest.json world size, stage, params, layout, index, sha256
    ckpt/step_200/rank_<r>.pt   rank r's fragments and RNG states
    ckpt/step_200/shared.pt     buffers, param-group hyperparameters, loss scaler, extra
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

FORMAT = "shardengine-universal/1"
MANIFEST = "manifest.json"
LATEST = "latest"
SHARED_FILE = "shared.pt"
STEP_DIR = re.compile(r"^step_(\d+)$")
# Optimizer state entries that are counters/scalars, not per-element tensors.
SCALAR_STATE_NAMES = frozenset({"step", "eta", "mu"})


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and the problem."""


# =========================================================================== public API


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: Optional[dict] = None, keep: Optional[int] = 3) -> str:
    """Save a sharded checkpoint of ``model`` and ``optimizer`` under ``path``; collective.

    Every rank writes its own shard in parallel; rank 0 writes the manifest and
    the shared state, then publishes the new ``step_<k>`` directory atomically
    and keeps the newest ``keep`` checkpoints (``None``: all). ``k`` is
    ``extra["step"]`` when that is an int, else one more than the newest step
    in ``path``. Returns the step directory.

    >>> import torch, shardengine as se                        # doctest: +SKIP
    >>> net = torch.nn.Linear(4, 2)                            # doctest: +SKIP
    >>> model, opt = se.shard(net, torch.optim.AdamW(net.parameters()), stage=2)  # doctest: +SKIP
    >>> se.save_checkpoint("ckpt", model, opt, extra={"step": 10})  # doctest: +SKIP
    'ckpt/step_10'
    """
    engine = _engine_of(model)
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (or None to keep all), got {keep}")
    comm = engine.comm
    step = _agree(comm, "choose the step", lambda: _choose_step(path, extra) if comm.rank == 0 else None)[0]
    tmp_dir = os.path.join(path, f".tmp_step_{step}")
    final_dir = os.path.join(path, f"step_{step}")
    _agree(comm, "prepare the temporary directory",
           lambda: _fresh_dir(tmp_dir) if comm.rank == 0 else None)
    entries = _agree(comm, "write the rank files",
                     lambda: _write_rank_files(tmp_dir, engine, optimizer, extra))
    _agree(comm, "publish the checkpoint", lambda: _publish(
        path, tmp_dir, final_dir, _manifest(engine, optimizer, entries), keep) if comm.rank == 0 else None)
    return final_dir


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Optional[dict]:
    """Restore ``model``, ``optimizer``, RNG states and loss scale from ``path``; collective.

    ``path`` is a checkpoint directory (its ``latest`` is followed) or one
    ``step_<k>`` directory. The checkpoint may come from any world size and
    stage. Returns the ``extra`` given to :func:`save_checkpoint`. On any
    problem raises :class:`CheckpointError` on every rank and changes nothing.

    >>> extra = se.load_checkpoint("ckpt", model, opt)         # doctest: +SKIP
    >>> start = extra["step"] + 1                              # doctest: +SKIP
    """
    engine = _engine_of(model)
    comm = engine.comm
    step_dir = _agree(comm, "find the checkpoint",
                      lambda: resolve_checkpoint(path) if comm.rank == 0 else None)[0]
    prepared: list[PreparedLoad] = []
    _agree(comm, f"read {step_dir}", lambda: prepared.append(_prepare_load(step_dir, engine, optimizer)))
    _apply(prepared[0], engine, optimizer)
    return prepared[0].extra


def latest_checkpoint(path: str) -> Optional[str]:
    """The step directory ``path/latest`` points at, or None when there is none yet.

    >>> latest_checkpoint("/nonexistent") is None
    True
    """
    pointer = os.path.join(path, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(path, f.read().strip())


def resolve_checkpoint(path: str) -> str:
    """The step directory to read for ``path`` (a step directory, or a directory with ``latest``)."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    step_dir = latest_checkpoint(path)
    if step_dir is None:
        raise CheckpointError(f"no checkpoint at {path}: neither {MANIFEST} nor a '{LATEST}' pointer")
    if not os.path.isfile(os.path.join(step_dir, MANIFEST)):
        raise CheckpointError(f"{os.path.join(path, LATEST)} points at {step_dir}, which has no {MANIFEST}")
    return step_dir


# =========================================================================== agreement


def _agree(comm, what: str, action: Callable[[], Any]) -> list[Any]:
    """Run ``action`` on every rank; return every rank's result, or raise everywhere.

    Exchanging the outcome is also the barrier between phases, so a failure on
    one rank stops all of them at the same point instead of leaving the others
    in a collective the failed rank never reaches.
    """
    try:
        outcome = ("ok", action())
    except Exception as error:  # noqa: BLE001 - reported to every rank below
        outcome = ("error", f"{type(error).__name__}: {error}" if not isinstance(error, CheckpointError)
                   else str(error))
    outcomes = comm.all_gather_object(outcome)
    failures = [(rank, text) for rank, (status, text) in enumerate(outcomes) if status == "error"]
    if failures:
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
        raise CheckpointError(f"checkpoint: could not {what} ({detail})")
    return [value for _, value in outcomes]


def _engine_of(model: nn.Module):
    engine = getattr(model, "_engine", None)
    if engine is None:
        raise TypeError(f"expected the model returned by shardengine.shard(), got {type(model).__name__}")
    return engine


# =========================================================================== model description


def param_keys(module: nn.Module) -> dict[int, list[str]]:
    """``id(param) -> its state_dict keys`` (a tied weight has several)."""
    keys: dict[int, list[str]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, nn.Parameter):
            keys.setdefault(id(tensor), []).append(key)
    return keys


def buffer_entries(module: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (and other non-parameter state), by state_dict key."""
    params = {id(p) for p in module.parameters()}
    return {key: value for key, value in module.state_dict(keep_vars=True).items()
            if id(value) not in params}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dtype


# =========================================================================== flat coordinates


@dataclass(frozen=True)
class FlatSource:
    """A 1-D tensor that holds flat-buffer elements ``[start, start + numel)``."""

    tensor: torch.Tensor
    start: int

    def piece(self, lo: int, hi: int) -> torch.Tensor:
        return self.tensor[lo - self.start:hi - self.start]


def _training_values(bucket) -> FlatSource:
    """Where this rank holds the bucket's training values: the master (fp32 truth) if any.

    The master covers the owned slice, or the whole buffer where the optimizer
    steps it whole (stage 0 with mixed precision); otherwise the parameters.
    """
    if bucket.master is not None:
        return FlatSource(bucket.master.detach().reshape(-1), _master_start(bucket))
    if bucket.full_params_live:
        return FlatSource(bucket.full_param.detach(), 0)
    return FlatSource(bucket.param_shard.detach(), bucket.owned.start)


def _master_start(bucket) -> int:
    return 0 if bucket.master.numel() == bucket.layout.padded_numel else bucket.owned.start


def _slot_pieces(layout, lo: int, hi: int) -> Iterable[tuple[int, int, int]]:
    """``(slot index, param_start, param_end)`` of parameters inside flat ``[lo, hi)``."""
    for index, slot in enumerate(layout.slots):
        a, b = max(slot.offset, lo), min(slot.end, hi)
        if a < b:
            yield index, a - slot.offset, b - slot.offset


def _optimizer_positions(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(param) -> position`` as in ``optimizer.state_dict()`` (groups concatenated)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): index for index, p in enumerate(params)}


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}


# =========================================================================== save: rank files


def _choose_step(path: str, extra: Optional[dict]) -> int:
    if isinstance(extra, dict) and isinstance(extra.get("step"), int) and extra["step"] >= 0:
        return extra["step"]
    steps = [step for step, _ in _step_dirs(path)]
    return max(steps) + 1 if steps else 0


def _step_dirs(path: str) -> list[tuple[int, str]]:
    if not os.path.isdir(path):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(path) if (m := STEP_DIR.match(name))]
    return sorted(found)


def _fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)  # leftovers of a save that crashed
    os.makedirs(path)


def _write_rank_files(tmp_dir: str, engine, optimizer, extra: Optional[dict]) -> dict:
    """This rank's file (and rank 0's shared file); returns their manifest entries."""
    rank = engine.comm.rank
    payload = {"format": FORMAT, "rank": rank, "records": _records(engine, optimizer), "rng": _rng_state()}
    name = f"rank_{rank}.pt"
    entries = {"files": {name: _write_file(payload, os.path.join(tmp_dir, name))},
               "index": {name: [[r["name"], r["start"], r["end"]] for r in payload["records"]]}}
    if rank == 0:
        shared = _shared_state(engine, optimizer, extra)
        entries["files"][SHARED_FILE] = _write_file(shared, os.path.join(tmp_dir, SHARED_FILE))
    return entries


def _records(engine, optimizer) -> list[dict]:
    """One record per fragment of every bucket's owned range, plus rank 0's loose params.

    Under hybrid sharding the shard groups hold the same ranges (replicas): only
    group 0 (ranks 0 .. k-1) writes them, so each element is saved once.
    """
    positions = _optimizer_positions(optimizer)
    records = []
    for bucket in engine.buckets if engine.comm.group_index == 0 else []:
        values = _training_values(bucket)
        lo, hi = bucket.owned.start, bucket.owned.stop
        for index, start, end in _slot_pieces(bucket.layout, lo, hi):
            records.append(_bucket_record(engine, optimizer, positions, bucket, values, index, start, end))
    if engine.comm.rank == 0:
        records += [_loose_record(engine, optimizer, positions, param) for param in _loose_params(engine)]
    return records


def _bucket_record(engine, optimizer, positions, bucket, values: FlatSource, index: int,
                   start: int, end: int) -> dict:
    param = bucket.params[index]
    offset = bucket.layout.slots[index].offset
    record = {"name": engine._name_of[id(param)], "start": start, "end": end,
              "value": values.piece(offset + start, offset + end).clone()}
    state = _state_source(optimizer, positions, bucket, param, offset)
    if state is not None:
        record.update(_state_pieces(*state, offset + start, offset + end))
    return record


def _state_source(optimizer, positions, bucket, param, offset: int):
    """``(state dict, flat start, key tensor)`` of the optimizer state covering ``param``."""
    piece = _piece_of(bucket, param)
    if piece is not None and id(piece.param) in positions:
        state = optimizer.state.get(piece.param)
        return (state, offset + piece.param_start, piece.param) if state else None
    if id(param) in positions:
        state = optimizer.state.get(param)
        return (state, offset, param) if state else None
    return None


def _piece_of(bucket, param):
    """The optimizer's tensor (one per fragment, see flat_bucket.py) holding ``param`` on this rank."""
    return next((piece for piece in bucket.master_pieces if bucket.params[piece.slot] is param), None)


def _state_pieces(state: dict, start: int, key: torch.Tensor, lo: int, hi: int) -> dict:
    """Element-wise entries sliced to flat ``[lo, hi)``; scalar entries whole."""
    elementwise, scalars = {}, {}
    for name, value in state.items():
        if _is_elementwise(name, value, key):
            elementwise[name] = value.detach().reshape(-1)[lo - start:hi - start].clone()
        else:
            scalars[name] = value.detach().clone() if torch.is_tensor(value) else value
    return {"state": elementwise, "scalars": scalars}


def _is_elementwise(name: str, value: Any, key: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == key.shape and name not in SCALAR_STATE_NAMES


def _loose_params(engine) -> list[nn.Parameter]:
    """Parameters outside every bucket (frozen ones at stages 0-2, empty ones): whole, from rank 0."""
    bucketed = {id(p) for b in engine.buckets for p in b.params}
    return [p for p in engine.module.parameters() if id(p) not in bucketed]


def _loose_record(engine, optimizer, positions, param: nn.Parameter) -> dict:
    flat = param.detach().reshape(-1)
    record = {"name": engine._name_of[id(param)], "start": 0, "end": flat.numel(), "value": flat.clone()}
    state = optimizer.state.get(param) if id(param) in positions else None
    if state:
        record.update(_state_pieces(state, 0, param, 0, flat.numel()))
    return record


def _shared_state(engine, optimizer, extra: Optional[dict]) -> dict:
    scaler = _loss_scaler(engine)
    return {"format": FORMAT,
            "buffers": {k: v.detach().clone() for k, v in buffer_entries(engine.module).items()
                        if torch.is_tensor(v)},  # get_extra_state() objects are not restored
            "param_groups": [{k: v for k, v in group.items() if k not in ("params", "param_names")}
                             for group in optimizer.param_groups],
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "extra": extra}


def _loss_scaler(engine):
    for name in ("loss_scaler", "scaler"):
        scaler = getattr(engine, name, None)
        if scaler is not None and hasattr(scaler, "state_dict"):
            return scaler
    return None


# =========================================================================== RNG


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": None, "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # lists and ints, so the file loads with weights_only=True
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("numpy") is not None:
        import numpy
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))


def _as_tuples(value):
    # random.setstate wants tuples; a file round trip may have turned them into lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# =========================================================================== save: files and publishing


def _write_file(obj: Any, path: str) -> dict:
    """torch.save + fsync; returns ``{"bytes", "sha256"}`` of what is on disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}


def sha256_of(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest(engine, optimizer, entries: list[dict]) -> dict:
    keys = param_keys(engine.module)
    group_of = _group_of(optimizer)
    value_dtype = _value_dtypes(engine)
    params = [{"name": name, "keys": keys.get(id(p), [name]), "shape": list(p.shape),
               "dtype": _dtype_name(value_dtype.get(id(p), p.dtype)), "compute_dtype": _dtype_name(p.dtype),
               "requires_grad": p.requires_grad}
              for name, p in engine.module.named_parameters()]
    return {
        "format": FORMAT,
        "world_size": engine.comm.world_size,
        "shard_group_size": engine.comm.group_size,
        "stage": engine.stage,
        "versions": {"torch": torch.__version__, "shardengine": _package_version(),
                     "python": sys.version.split()[0]},
        "params": params,
        "state_dict_keys": list(engine.module.state_dict(keep_vars=True)),
        "buffers": {k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)}
                    for k, v in buffer_entries(engine.module).items() if torch.is_tensor(v)},
        "optimizer": {"class": type(optimizer).__name__, "param_groups": len(optimizer.param_groups)},
        "layout": [{"params": [engine._name_of[id(p)] for p in b.params],
                    "slots": [[s.offset, s.numel] for s in b.layout.slots],
                    "padded_numel": b.layout.padded_numel, "shard_numel": b.layout.shard_numel,
                    "group_index": group_of.get(id(b.params[0]), b.group_index),
                    "requires_grad": b.requires_grad}
                   for b in engine.buckets],
        "files": {name: info for entry in entries for name, info in entry["files"].items()},
        "index": {name: index for entry in entries for name, index in entry["index"].items()},
    }


def _value_dtypes(engine) -> dict[int, torch.dtype]:
    """``id(param) -> dtype of its saved values``: the master's (fp32 under mixed precision)."""
    return {id(p): b.master.dtype for b in engine.buckets if b.master is not None for p in b.params}


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("shardengine")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def _publish(root: str, tmp_dir: str, final_dir: str, manifest: dict, keep: Optional[int]) -> None:
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


# =========================================================================== load: reading ranges


class CheckpointReader:
    """Verified, lazy access to one step directory's files, by parameter name and range.

    Files are checked (size, sha256) when first needed and memory-mapped, so a
    reader holds little beyond what the caller copies out.
    """

    def __init__(self, step_dir: str):
        self.step_dir = step_dir
        self.manifest = read_manifest(step_dir)
        self.params = {p["name"]: p for p in self.manifest["params"]}
        self._where: dict[str, list[tuple[int, int, str]]] = {}
        for file, index in self.manifest["index"].items():
            for name, start, end in index:
                self._where.setdefault(name, []).append((start, end, file))
        self._loaded: dict[str, dict] = {}
        self._records: dict[str, dict[tuple[str, int], dict]] = {}

    # -- files

    def path(self, file: str) -> str:
        return os.path.join(self.step_dir, file)

    def check_present(self) -> None:
        """Every file of the manifest exists with its recorded size (cheap: no hashing)."""
        for file, info in self.manifest["files"].items():
            _check_size(self.path(file), info["bytes"])

    def verify(self, file: str) -> None:
        info = self.manifest["files"].get(file)
        if info is None:
            raise CheckpointError(f"{self.path(file)}: not listed in {MANIFEST}")
        path = self.path(file)
        _check_size(path, info["bytes"])
        actual = sha256_of(path)
        if actual != info["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch (file {actual[:16]}..., manifest "
                                  f"{info['sha256'][:16]}...): the file is corrupt")

    def load(self, file: str, trusted_objects: bool = False) -> dict:
        """The verified contents of ``file`` (``trusted_objects``: may hold user objects)."""
        if file not in self._loaded:
            self.verify(file)
            try:
                self._loaded[file] = torch.load(self.path(file), map_location="cpu", mmap=True,
                                                weights_only=not trusted_objects)
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
        for start, end, file in sorted(self._where.get(name, [])):
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
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a complete checkpoint)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from error
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _check_size(path: str, expected: int) -> None:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (the manifest lists it; was a rank's file lost?)")
    actual = os.path.getsize(path)
    if actual != expected:
        kind = "truncated" if actual < expected else "longer than recorded"
        raise CheckpointError(f"{path}: {kind}: {actual} bytes, the manifest says {expected}")


# =========================================================================== load: prepare (no writes)


@dataclass
class PreparedLoad:
    """Everything to write into this rank's model and optimizer, already read and verified."""

    bucket_values: list[Optional[torch.Tensor]] = field(default_factory=list)  # flat range per bucket
    bucket_ranges: list[tuple[int, int]] = field(default_factory=list)
    loose_values: dict[int, torch.Tensor] = field(default_factory=dict)  # id(param) -> full value
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict = field(default_factory=dict)
    rng: Optional[dict] = None
    loss_scaler: Optional[dict] = None
    extra: Optional[dict] = None


def _prepare_load(step_dir: str, engine, optimizer) -> PreparedLoad:
    reader = CheckpointReader(step_dir)
    if engine.comm.rank == 0:
        reader.check_present()  # a missing file is reported even if rank 0 does not need it
    check_same_model(reader, engine, optimizer)
    # shared.pt holds the user's ``extra`` (any picklable object), so it is unpickled in full,
    # like any torch.load of one's own training state; its sha256 was checked first.
    shared = reader.load(SHARED_FILE, trusted_objects=True)
    prepared = PreparedLoad(extra=shared["extra"], loss_scaler=shared["loss_scaler"])
    prepared.buffers = _read_buffers(reader, shared, engine)
    positions = _optimizer_positions(optimizer)
    state: dict[int, dict] = {}
    for bucket in engine.buckets:
        lo, hi = _load_range(bucket)
        prepared.bucket_ranges.append((lo, hi))
        prepared.bucket_values.append(_read_flat(reader, engine, bucket, lo, hi))
        _read_bucket_state(reader, engine, bucket, positions, (lo, hi), state)
    for param in _loose_params(engine):
        name = engine._name_of[id(param)]
        prepared.loose_values[id(param)] = _read_range(reader, name, 0, param.numel(), "value")
        if id(param) in positions:
            _put_param_state(reader, engine, param, positions, state)
    prepared.optimizer_state = _optimizer_state_dict(optimizer, shared["param_groups"], state)
    rank_file = f"rank_{engine.comm.rank}.pt"
    if rank_file in reader.manifest["files"]:  # ranks beyond the saved world keep their RNG
        prepared.rng = reader.load(rank_file)["rng"]
    return prepared


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
    if saved_opt["class"] != type(optimizer).__name__:
        problems.append(f"optimizer is {saved_opt['class']} in the checkpoint, "
                        f"{type(optimizer).__name__} now")
    if saved_opt["param_groups"] != len(optimizer.param_groups):
        problems.append(f"optimizer has {saved_opt['param_groups']} param groups in the checkpoint, "
                        f"{len(optimizer.param_groups)} now")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"{where}: the checkpoint is of a different model layout: {shown}")


def _read_buffers(reader: CheckpointReader, shared: dict, engine) -> dict[str, torch.Tensor]:
    buffers = {}
    for key, target in buffer_entries(engine.module).items():
        if not torch.is_tensor(target):
            continue
        value = shared["buffers"][key]
        if torch.is_tensor(target) and tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(f"{reader.path(SHARED_FILE)}: buffer {key} has shape "
                                  f"{list(value.shape)}, the model's has {list(target.shape)}")
        buffers[key] = value
    return buffers


def _load_range(bucket) -> tuple[int, int]:
    """The flat range this rank must restore: what its optimizer steps, or its parameters hold."""
    if bucket.master is not None:
        start = _master_start(bucket)
        return start, start + bucket.master.numel()
    if bucket.full_params_live:
        return 0, bucket.layout.padded_numel
    return bucket.owned.start, bucket.owned.stop


def _read_flat(reader, engine, bucket, lo: int, hi: int) -> torch.Tensor:
    """Training values of flat ``[lo, hi)``; padding stays zero (as the engine keeps it)."""
    out = None
    for index, start, end in _slot_pieces(bucket.layout, lo, hi):
        name = engine._name_of[id(bucket.params[index])]
        piece = _read_range(reader, name, start, end, "value")
        if out is None:
            out = torch.zeros(hi - lo, dtype=piece.dtype)
        offset = bucket.layout.slots[index].offset
        out[offset + start - lo:offset + end - lo] = piece
    return out if out is not None else torch.zeros(hi - lo)


def _read_range(reader: CheckpointReader, name: str, lo: int, hi: int, key: str) -> torch.Tensor:
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


def _read_bucket_state(reader, engine, bucket, positions, flat_range: tuple[int, int],
                       state: dict[int, dict]) -> None:
    """Optimizer state for this bucket's optimizer keys (the master, or each parameter)."""
    if bucket.master_pieces:
        for piece in bucket.master_pieces:
            if id(piece.param) in positions:
                name = engine._name_of[id(bucket.params[piece.slot])]
                part = read_state(reader, name, piece.param_start, piece.param_end)
                if part is not None:
                    state[positions[id(piece.param)]] = part.as_state()
        return
    for param in bucket.params:
        if id(param) in positions:
            _put_param_state(reader, engine, param, positions, state)


def _put_param_state(reader, engine, param, positions, state: dict[int, dict]) -> None:
    part = read_state(reader, engine._name_of[id(param)], 0, param.numel())
    if part is not None:
        state[positions[id(param)]] = part.as_state(param.shape)


def _optimizer_state_dict(optimizer, saved_groups: list[dict], state: dict[int, dict]) -> dict:
    """The current optimizer's state_dict with the checkpoint's state and hyperparameters
    (keeping the current one's layout tag, so it loads as this rank's sharded form)."""
    current = optimizer.state_dict()
    groups = [{**saved, **{k: v for k, v in group.items() if k in ("params", "param_names")}}
              for group, saved in zip(current["param_groups"], saved_groups)]
    return {**{k: v for k, v in current.items() if k not in ("state", "param_groups")},
            "state": state, "param_groups": groups}


# =========================================================================== load: apply


def _apply(prepared: PreparedLoad, engine, optimizer) -> None:
    """Write what was read; the only collective is the parameter all-gather of stages 1-2."""
    with torch.no_grad():
        for bucket, values, (lo, hi) in zip(engine.buckets, prepared.bucket_values, prepared.bucket_ranges):
            _write_bucket(bucket, values, lo, hi)
        for param in _loose_params(engine):
            param.copy_(prepared.loose_values[id(param)].reshape(param.shape))
        targets = buffer_entries(engine.module)
        for key, value in prepared.buffers.items():
            if torch.is_tensor(targets[key]):
                targets[key].copy_(value)
        _refresh_full_params(engine, prepared.bucket_ranges)
    optimizer.load_state_dict(prepared.optimizer_state)
    scaler = _loss_scaler(engine)
    if scaler is not None and prepared.loss_scaler is not None:
        scaler.load_state_dict(prepared.loss_scaler)
    if prepared.rng is not None:
        _set_rng_state(prepared.rng)


def _write_bucket(bucket, values: torch.Tensor, lo: int, hi: int) -> None:
    """Master (if any) and the compute copy of flat ``[lo, hi)``."""
    if bucket.master is not None:
        bucket.master.detach().reshape(-1).copy_(values)
    if bucket.full_params_live:
        bucket.full_param[lo:hi].copy_(values)
    else:
        owned = bucket.owned
        bucket.param_shard.copy_(values[owned.start - lo:owned.stop - lo])


def _refresh_full_params(engine, ranges: list[tuple[int, int]]) -> None:
    """Stages 1-2 restored only the owned slices: gather the full parameters like after a step."""
    works = [engine.comm.all_gather(b.full_param, b.param_shard, async_op=True)
             for b, (lo, hi) in zip(engine.buckets, ranges)
             if b.full_params_live and (lo, hi) != (0, b.layout.padded_numel)]
    for work in works:
        work.wait()
