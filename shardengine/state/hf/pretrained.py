"""Pretrained weights in and out of a sharded model, in the format the ecosystem reads.

``load_pretrained(model, path)`` streams a safetensors checkpoint (one file, or
shards with ``model.safetensors.index.json``) or a torch state dict into the
model returned by :func:`shardengine.shard`, at any stage.
``save_pretrained(model, folder)`` writes Hugging Face's layout: sharded
safetensors files, the index, and ``config.json`` when the module has a config.

[Note: each rank reads only what it holds]
Loading walks the engine's flat buckets: for each, the flat range this rank
must restore (its owned slice, or the whole buffer where it steps the whole
buffer: ``checkpoint._load_range``) is cut into parameter pieces and each
piece is read as an element range of the stored tensor, memory-mapped, then
copied into the fp32 master (full precision under mixed precision) and the
compute copy. Peak host memory is the rank's shard plus one tensor's piece;
nothing ever materializes the full model. Stages 1-2 then all-gather the
parameters as after a step.

[Note: verified before anything is written]
Every rank first checks everything that can be checked without the data:
files present, headers complete (a truncated file fails here), every model
tensor found under one name, no checkpoint tensor left over, shapes equal.
The ranks agree on the outcome (every one raises, naming the problems, or
none does) before a single value is written, so bad input leaves the model
untouched. A read that fails after that (a disk error mid-load) is reported
the same way, but the model is then partly loaded.

[Note: saving one unit at a time, files spread over ranks]
The files are planned up front (names, dtypes, shapes, offsets), so every
file's header is known before any data and each tensor is written at its
offset whenever its values are complete. Buckets are taken one at a time;
where a rank holds only its slice (stage 3, and the fp32 masters of stages 1-2
under mixed precision) the slices are all-gathered for that bucket only, so
a rank holds at most one bucket beyond its shard. Every rank has the gathered
bucket, so the files are spread over ranks (file i by rank i mod N): the
serialization and disk writes run in parallel at no extra communication.
That assumes the folder is on a file system all ranks share (as
:func:`save_checkpoint` does); rank 0 checks every file's size before it
publishes the index, so a folder that is not shared is an error, not a
silently incomplete checkpoint.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from ...errors import CheckpointError
from ..checkpoint import _agree, _engine_of
from ..checkpoint.engine_state import _load_range, _loose_params, _refresh_full_params, _slot_pieces, _training_values
from ..checkpoint.format import buffer_entries, param_keys
from ...flat.quantized import quantize, source_of as quantized_source
from .peft_keys import PeftBase, peft_base
from .prequantized import check_state_found, claimed_names, dtype_problems, find_stored_codes, read_stored_state
from .state_keys import KeyMatch, match_keys
from .weight_files import (SAFE_INDEX, SafetensorsWriter, WeightFiles, entry_bytes, file_bytes, file_names, parse_size,
                           plan_files, write_index)
from ...engine_api import Engine

PARTIAL = ".partial"


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_pretrained` did."""

    tensors: int                 # model tensors loaded (a tied weight counts once)
    bytes_read: int              # bytes this rank read from the files
    seconds: float
    key_mapping: str             # how model keys were found in the checkpoint
    missing: list[str] = field(default_factory=list)     # model keys left as they were
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys not loaded
    outside: list[str] = field(default_factory=list)     # checkpoint keys outside the mapped prefix


# =========================================================================== load


def load_pretrained(model: nn.Module, path: str, strict: bool = True) -> LoadReport:
    """Stream pretrained weights from ``path`` into a sharded ``model``; collective.

    ``path``: a folder as ``save_pretrained`` writes it, or one ``*.safetensors``,
    ``*.index.json`` or ``torch.save`` state-dict file. Keys are matched by
    name (see ``state/hf/state_keys.py`` for prefixes); a tied weight is read once. With
    ``strict`` (the default) a model tensor the checkpoint lacks, or a
    checkpoint tensor nothing reads, is an error; shape mismatches always are.
    Errors raise :class:`CheckpointError` on every rank, naming the tensors,
    with the model untouched.

    >>> model, opt = se.shard(net, torch.optim.AdamW(net.parameters()), stage=3)  # doctest: +SKIP
    >>> se.load_pretrained(model, "llama-pretrained/")                           # doctest: +SKIP
    LoadReport(tensors=..., ...)
    """
    engine = _engine_of(model)
    started = time.perf_counter()
    plans: list[_LoadPlan] = []
    _agree(engine.comm, f"load {path}", lambda: plans.append(_plan_load(engine, path, strict)))
    plan = plans[0]
    read = []
    _agree(engine.comm, f"read the weights from {path} (the model is now partly loaded)",
           lambda: read.append(_write_owned(engine, plan)))
    with torch.no_grad():
        _refresh_full_params(engine, [_load_range(b) for b in engine.buckets])
    match = plan.match
    return LoadReport(len(match.source), read[0], time.perf_counter() - started, plan.mapping,
                      match.missing + match.optional_missing, match.unexpected, match.outside)


@dataclass
class _LoadPlan:
    files: WeightFiles
    match: KeyMatch
    source_of: dict[int, str]            # id(param) -> checkpoint name
    buffers: dict[str, tuple[torch.Tensor, str]]  # model key -> (buffer, checkpoint name)
    mapping: str                         # how the model's keys were found, in words
    stored_codes: dict[int, dict[str, str]]  # id(param) -> stored state names (state/hf/prequantized.py)


def _plan_load(engine: Engine, path: str, strict: bool) -> _LoadPlan:
    """Open and check everything (no data read, nothing written)."""
    files = WeightFiles(path)
    module = engine.module
    keys_of = param_keys(module)
    params = {id(p): p for p in module.parameters()}
    buffers = {k: v for k, v in buffer_entries(module).items() if torch.is_tensor(v)}
    peft = peft_base(module)
    if peft is not None:  # a base checkpoint into a PEFT model: the base's names, adapters left out
        module, keys_of, buffers = peft.model, _base_keys_of(peft, keys_of), _base_buffers(peft, buffers)
    tensor_keys = [keys_of[pid] for pid in params if pid in keys_of] + [[k] for k in buffers]
    match = _match(module, files, tensor_keys)
    source_of = {pid: match.source[keys_of[pid][0]] for pid in params
                 if pid in keys_of and keys_of[pid][0] in match.source}
    stored_codes = find_stored_codes(params, source_of, files)  # a pre-quantized folder's weights
    check_state_found(stored_codes, source_of, params)
    claimed = claimed_names(stored_codes)
    match.unexpected = [name for name in match.unexpected if name not in claimed]
    names = {pid: keys[0] for pid, keys in keys_of.items()}
    wrong_dtypes = dtype_problems(params, source_of, files, stored_codes, names)
    if wrong_dtypes:
        raise CheckpointError(f"{path} does not fit the model: dtypes differ: {_listed(wrong_dtypes)}")
    # a quantized weight is checked, and read, as the checkpoint holds it (flat/quantized.py)
    shapes = {keys_of[pid][0]: p.shape if pid in stored_codes else (quantized_source(p) or (p.shape,))[0]
              for pid, p in params.items() if pid in keys_of}
    shapes.update({k: v.shape for k, v in buffers.items()})
    _check_match(path, files, match, shapes, strict, type(module).__module__.startswith("transformers."))
    loaded_buffers = {k: (v, match.source[k]) for k, v in buffers.items() if k in match.source}
    mapping = f"{peft}, {match.mapping}" if peft is not None else str(match.mapping)
    return _LoadPlan(files, match, source_of, loaded_buffers, mapping, stored_codes)


def _base_keys_of(peft: PeftBase, keys_of: dict[int, list[str]]) -> dict[int, list[str]]:
    """``id(param) -> the base checkpoint's keys`` for the base's tensors (adapters dropped)."""
    mapped = {}
    for pid, keys in keys_of.items():
        base = [k for k in map(peft.key, keys) if k is not None]
        if pid not in peft.adapters and base:
            mapped[pid] = list(dict.fromkeys(base))
    return mapped


def _base_buffers(peft: PeftBase, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mapped = {}
    for key, buffer in buffers.items():
        base = peft.key(key)
        if base is not None and id(buffer) not in peft.adapters:
            mapped.setdefault(base, buffer)
    return mapped


def _match(module: nn.Module, files: WeightFiles, tensor_keys: list[list[str]]) -> KeyMatch:
    """Model tensors to stored names (see ``state/hf/state_keys.py``), with the model's own hints."""
    stored_as = _stored_names(module, files.tensors)
    match = match_keys(tensor_keys, set(stored_as), getattr(module, "base_model_prefix", None),
                       getattr(module, "_keys_to_ignore_on_load_missing", None) or (),
                       getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ())
    match.source = {key: stored_as[name] for key, name in match.source.items()}
    match.unexpected = [stored_as[name] for name in match.unexpected]
    match.outside = [stored_as[name] for name in match.outside]
    return match


def _stored_names(module: nn.Module, stored: dict) -> dict[str, str]:
    """``name to match -> name in the files``: for a transformers model, its own renamings of
    older checkpoints' names applied (``embed_out`` -> ``lm_head``, ``gamma`` -> ``weight``,
    ...); tensors its converters would fuse (MoE experts stored one by one) keep their names
    and so stay unmatched. Any other model, or a transformers without that API: as stored."""
    names = {name: name for name in stored}
    if not type(module).__module__.startswith("transformers."):
        return names
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
        renamings = [t for t in get_model_conversion_mapping(module) if isinstance(t, WeightRenaming)]
        renamed = {name: rename_source_key(name, renamings, [])[0] for name in stored}
    except Exception:  # noqa: BLE001 - an internal API of transformers: without it, names as stored
        return names
    matched: dict[str, str] = {}
    for name, new in renamed.items():  # a stored name that needs no renaming wins a collision
        if new not in stored or new == name:
            matched.setdefault(new, name)
    return matched


def _check_match(path: str, files: WeightFiles, match: KeyMatch, shapes: dict, strict: bool,
                 hf_model: bool) -> None:
    problems = []
    if strict and match.missing:
        problems.append(f"missing from the checkpoint: {_listed(match.missing)}")
    if strict and match.unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listed(match.unexpected)}")
    mismatched = [f"{key} (checkpoint {list(files.tensors[source].shape)}, model {list(shapes[key])})"
                  for key, source in match.source.items()
                  if tuple(files.tensors[source].shape) != tuple(shapes[key])]
    if mismatched:
        problems.append(f"shapes differ: {_listed(mismatched)}")
    if problems:
        note = f" (matched {match.mapping})" if match.mapping.add or match.mapping.strip else ""
        hint = "; strict=False loads what matches" if strict and not mismatched else ""
        if hf_model and match.missing and match.unexpected:
            hint += ("; names are matched as they are: transformers' own renaming or fusing of some "
                     "checkpoints' tensors on load (e.g. MoE experts stored one by one) is not applied")
        raise CheckpointError(f"{path} does not fit the model{note}: " + "; ".join(problems) + hint)


def _write_owned(engine: Engine, plan: _LoadPlan) -> int:
    """Read this rank's pieces and write them into masters and compute copies; bytes read."""
    pieces = []
    for bucket in engine.buckets:
        lo, hi = _load_range(bucket)
        for index, start, end in _slot_pieces(bucket.layout, lo, hi):
            source = plan.source_of.get(id(bucket.params[index]))
            if source is not None:
                pieces.append((plan.files.read_order(source), bucket, index, start, end))
    read = 0
    with torch.no_grad():
        for (_, source), bucket, index, start, end in sorted(pieces, key=lambda p: p[0]):
            data, read_bytes = _read_piece(plan, source, bucket.params[index], start, end)
            offset = bucket.layout.slots[index].offset
            _write_piece(bucket, offset + start, offset + end, data)
            read += read_bytes
        read += _quantize_unowned(engine, plan, {id(p[1].params[p[2]]) for p in pieces})
        for param in _loose_params(engine):
            source = plan.source_of.get(id(param))
            if source is not None and param.numel() > 0:
                data = plan.files.read(source, 0, param.numel())
                param.copy_(data.reshape(param.shape))
                read += data.numel() * data.element_size()
        for buffer, source in plan.buffers.values():
            data = plan.files.read(source, 0, buffer.numel())
            buffer.copy_(data.reshape(buffer.shape))
            read += data.numel() * data.element_size()
    plan.files.release()
    return read


def _read_piece(plan: _LoadPlan, source: str, param: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, int]:
    """Flat ``[start, end)`` of ``param``'s stored values, and the bytes read for it: of the
    checkpoint's tensor; of its bitsandbytes codes, quantized from the whole tensor (one at
    a time, every rank alike); or of codes stored pre-quantized, with their whole state."""
    files, stored_state = plan.files, plan.stored_codes.get(id(param))
    if quantized_source(param) is None or stored_state is not None:
        data = files.read(source, start, end)
        state_bytes = 0 if stored_state is None else read_stored_state(files, param, source, stored_state)
        return data, data.numel() * data.element_size() + state_bytes
    whole = files.read(source, 0, files.tensors[source].numel)
    return quantize(param, whole)[start:end], whole.numel() * whole.element_size()


def _quantize_unowned(engine: Engine, plan: _LoadPlan, quantized: set[int]) -> int:
    """The quantization state of quantized weights none of whose codes this rank holds: every
    rank computes it from the checkpoint, or reads it stored (the state is whole on every
    rank). Bytes read."""
    read = 0
    for bucket in engine.buckets:
        for param in bucket.params:
            source = plan.source_of.get(id(param))
            if source is None or quantized_source(param) is None or id(param) in quantized:
                continue
            if id(param) in plan.stored_codes:
                read += read_stored_state(plan.files, param, source, plan.stored_codes[id(param)])
            else:
                quantize(param, plan.files.read(source, 0, plan.files.tensors[source].numel))
                read += plan.files.tensors[source].numel * plan.files.tensors[source].dtype.itemsize
    return read


def _write_piece(bucket, lo: int, hi: int, data: torch.Tensor) -> None:
    """Flat ``[lo, hi)`` of the training values (the master, full precision) and, when the
    master is a copy of its own, of the compute copy too."""
    _training_values(bucket).piece(lo, hi).copy_(data)
    if bucket.master_is_separate:
        bucket.write_compute_copy(data, lo, hi)


# =========================================================================== save


def save_pretrained(model: nn.Module, folder: str, max_shard_size: Union[int, str] = "5GB",
                    dtype: Optional[torch.dtype] = None) -> list[str]:
    """Write ``model`` as Hugging Face does: safetensors files (+ index), ``config.json``; collective.

    Values are the training values (fp32 masters under mixed precision),
    cast to ``dtype`` when given (floating tensors only). No rank holds more
    than one gathered bucket beyond its shard. A tied weight is written once,
    under the name ``from_pretrained`` ties from. Returns the files written.

    >>> se.save_pretrained(model, "finetuned/")                        # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained("finetuned/")             # doctest: +SKIP
    """
    engine = _engine_of(model)
    comm = engine.comm
    plan = _plan_save(engine, parse_size(max_shard_size), dtype)
    _agree(comm, f"create {folder}", lambda: os.makedirs(folder, exist_ok=True) if comm.rank == 0 else None)
    writers: dict[str, SafetensorsWriter] = {}
    _agree(comm, f"open the weight files in {folder}",
           lambda: writers.update(_open_writers(folder, plan, comm.rank, comm.world_size)))
    failure = _stream_values(engine, plan, writers)
    _agree(comm, f"write the weight files in {folder}", lambda: _close_writers(writers, failure))
    _agree(comm, f"publish {folder}",
           lambda: _publish(folder, plan, engine.module, comm.world_size) if comm.rank == 0 else None)
    return [os.path.join(folder, name) for name in plan.file_names] + (
        [os.path.join(folder, SAFE_INDEX)] if len(plan.files) > 1 else [])


@dataclass
class _SavePlan:
    files: list[list[tuple[str, torch.dtype, tuple[int, ...]]]]
    file_names: list[str]
    file_of: dict[str, int]              # saved key -> file index
    key_of: dict[int, str]               # id(param) -> the key it is saved under
    buffers: dict[str, torch.Tensor]     # saved key -> buffer
    dtype: Optional[torch.dtype]

    def out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor


def _plan_save(engine: Engine, max_file_bytes: int, dtype: Optional[torch.dtype]) -> _SavePlan:
    module = engine.module
    skip = set(getattr(module, "_keys_to_ignore_on_save", None) or ())
    tied_targets = set(getattr(module, "all_tied_weights_keys", None) or {})
    key_of = {}
    for pid, keys in param_keys(module).items():
        kept = [k for k in keys if k not in skip]
        if kept:
            key_of[pid] = next((k for k in kept if k not in tied_targets), kept[0])
    held = _held_dtypes(engine)
    params = {id(p): p for p in module.parameters()}
    buffers = {k: v for k, v in buffer_entries(module).items() if torch.is_tensor(v) and k not in skip}
    param_of_key = {key: pid for pid, key in key_of.items()}
    entries = []
    for key in module.state_dict(keep_vars=True):  # state_dict order, as save_pretrained writes
        pid = param_of_key.get(key)
        if pid is not None:
            tensor_dtype, shape = held[pid], tuple(params[pid].shape)
        elif key in buffers:
            tensor_dtype, shape = buffers[key].dtype, tuple(buffers[key].shape)
        else:
            continue
        if dtype is not None and tensor_dtype.is_floating_point:
            tensor_dtype = dtype
        entries.append((key, tensor_dtype, shape))
    files = plan_files(entries, max_file_bytes)
    file_of = {entry[0]: index for index, file in enumerate(files) for entry in file}
    return _SavePlan(files, file_names(len(files)), file_of, key_of, buffers, dtype)


def _held_dtypes(engine: Engine) -> dict[int, torch.dtype]:
    """``id(param) -> dtype`` of the training values this engine keeps for it."""
    held = {id(p): p.dtype for p in engine.module.parameters()}
    for bucket in engine.buckets:
        dtype = _training_values(bucket).tensor.dtype
        held.update({id(p): dtype for p in bucket.params})
    return held


def _open_writers(folder: str, plan: _SavePlan, rank: int, world: int) -> dict[str, SafetensorsWriter]:
    """This rank's files (file i is written by rank i mod N), by the keys they hold."""
    writers = {}
    for index, (name, entries) in enumerate(zip(plan.file_names, plan.files)):
        if index % world == rank:
            writer = SafetensorsWriter(os.path.join(folder, name + PARTIAL), entries)
            writers.update({entry[0]: writer for entry in entries})
    return writers


def _stream_values(engine: Engine, plan: _SavePlan, writers: dict[str, SafetensorsWriter]) -> Optional[str]:
    """Write this rank's tensors, bucket by bucket; keep joining the collectives after a
    failure (the ranks agree on it afterwards) and return its description."""
    failure = None

    def write(key: str, tensor: torch.Tensor) -> None:
        nonlocal failure
        if failure is None and key in writers:
            try:
                writers[key].write(key, plan.out(tensor))
            except Exception as error:  # noqa: BLE001 - reported by every rank after the stream
                failure = f"{type(error).__name__}: {error}"

    with torch.no_grad():
        for bucket in engine.buckets:
            full = _full_values(engine, bucket)
            for param, slot in zip(bucket.params, bucket.layout.slots):
                if id(param) in plan.key_of:
                    write(plan.key_of[id(param)], full[slot.offset:slot.end].view(slot.shape))
            del full
        for param in _loose_params(engine):
            if id(param) in plan.key_of:
                write(plan.key_of[id(param)], param.detach())
        for key, buffer in plan.buffers.items():
            write(key, buffer.detach())
    return failure


def _full_values(engine: Engine, bucket) -> torch.Tensor:
    """The bucket's whole flat training values: held here, or all-gathered from the slices."""
    values = _training_values(bucket)
    padded = bucket.layout.padded_numel
    if values.start == 0 and values.tensor.numel() == padded:
        return values.tensor
    if bucket.full_params_live and not bucket.master_is_separate:
        return bucket.full_param.detach()  # the master is a view of it (fp32 stages 1-2)
    device = bucket.full_param.device
    full = torch.empty(padded, dtype=values.tensor.dtype, device=device)
    engine.comm.all_gather(full, values.tensor.to(device))
    return full


def _close_writers(writers: dict[str, SafetensorsWriter], failure: Optional[str]) -> None:
    for writer in {id(w): w for w in writers.values()}.values():
        if failure is None:
            writer.close()
        else:
            writer.abort()
    if failure is not None:
        raise CheckpointError(failure)


def _publish(folder: str, plan: _SavePlan, module: nn.Module, world: int) -> None:
    """Rank 0: every file complete, moved into place, stale weight files gone, index and config."""
    for name, entries in zip(plan.file_names, plan.files):
        partial = os.path.join(folder, name + PARTIAL)
        size = os.path.getsize(partial) if os.path.isfile(partial) else None
        if size != file_bytes(entries):
            raise CheckpointError(f"{partial}: {'missing' if size is None else f'{size} bytes'}, expected "
                                  f"{file_bytes(entries)} bytes from rank {plan.file_names.index(name) % world}; "
                                  "the folder must be on a file system every rank shares")
    for name in plan.file_names:
        os.replace(os.path.join(folder, name + PARTIAL), os.path.join(folder, name))
    _remove_stale(folder, set(plan.file_names))
    entries = [entry for file in plan.files for entry in file]
    if len(plan.files) > 1:
        write_index(folder, {key: plan.file_names[i] for key, i in plan.file_of.items()}, entries)
    _write_config(folder, module, entries)


def _remove_stale(folder: str, current: set[str]) -> None:
    """Weight files of an earlier save that the new one does not replace (they would mislead a loader)."""
    for name in os.listdir(folder):
        stale_weights = name.startswith("model") and name.endswith(".safetensors") and name not in current
        stale_index = name == SAFE_INDEX and len(current) == 1
        if stale_weights or stale_index:
            os.remove(os.path.join(folder, name))


def _write_config(folder: str, module: nn.Module, entries: list) -> None:
    """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    floats = [e for e in entries if e[1].is_floating_point]
    if floats:  # the dtype most of the bytes are in: what from_pretrained(dtype="auto") picks
        by_dtype: dict[torch.dtype, int] = {}
        for entry in floats:
            by_dtype[entry[1]] = by_dtype.get(entry[1], 0) + entry_bytes(entry)
        config.dtype = str(max(by_dtype, key=by_dtype.get)).removeprefix("torch.")
    config.architectures = [type(module).__name__]
    config.save_pretrained(folder)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(folder)


def _listed(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
