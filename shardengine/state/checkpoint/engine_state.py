"""Between the engine and the universal records: what a rank saves, and what it restores.

[Note: the universal format]
A checkpoint is keyed by *parameter name and element range*, not by rank or
flat-buffer offset. Rank r writes, for every flat bucket, the fragments of
its owned range (``layout.fragments(r)``): ``(name, start, end)`` within the
flattened parameter, the fp32 training values there (the master when there
is one) and the matching slice of every element-wise optimizer state tensor.
Scalar states (``step``) travel with each fragment. Loading at any world size
M and stage t is then just reading ranges: each rank asks for the ranges it
holds in the *new* layout, and the manifest's index says which files hold
them. Element-wise optimizers only (the engine refuses others at stages >= 1),
so slicing and re-joining state is exact.

This is the one module that knows how the engine holds values and optimizer
state (flat buckets, masters, owned slices); the rest of the package deals in
files and records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn

from .format import FORMAT, SCALAR_STATE_NAMES, SHARED_FILE, buffer_entries
from ...errors import CheckpointError
from .index import ManifestIndex
from .reading import CheckpointReader, check_same_model, read_range, read_state
from .rng import set_rng_state
from ...engine_api import Engine


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
    return FlatSource(bucket.shard_values().detach(), bucket.owned.start)


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



# =========================================================================== save: records


def _records(engine: Engine, optimizer) -> list[dict]:
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


def _bucket_record(engine: Engine, optimizer, positions, bucket, values: FlatSource, index: int,
                   start: int, end: int) -> dict:
    param = bucket.params[index]
    offset = bucket.layout.slots[index].offset
    record = {"name": engine.params.name(param), "start": start, "end": end,
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
    """The optimizer's tensor (one per fragment, see flat/bucket.py) holding ``param`` on this rank."""
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


def _loose_params(engine: Engine) -> list[nn.Parameter]:
    """Parameters outside every bucket (frozen ones at stages 0-2, empty ones): whole, from rank 0."""
    bucketed = {id(p) for b in engine.buckets for p in b.params}
    return [p for p in engine.module.parameters() if id(p) not in bucketed]


def _loose_record(engine: Engine, optimizer, positions, param: nn.Parameter) -> dict:
    flat = param.detach().reshape(-1)
    record = {"name": engine.params.name(param), "start": 0, "end": flat.numel(), "value": flat.clone()}
    state = optimizer.state.get(param) if id(param) in positions else None
    if state:
        record.update(_state_pieces(state, 0, param, 0, flat.numel()))
    return record


def _shared_state(engine: Engine, optimizer, extra: Optional[dict]) -> dict:
    scaler = _loss_scaler(engine)
    return {"format": FORMAT,
            "buffers": {k: v.detach().clone() for k, v in buffer_entries(engine.module).items()
                        if torch.is_tensor(v)},  # get_extra_state() objects are not restored
            "param_groups": [{k: v for k, v in group.items() if k not in ("params", "param_names")}
                             for group in optimizer.param_groups],
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            # the agreed weight per micro-step (step/batch_weights.py): resuming with it is bit-identical
            "batch_weight_reference": engine.weights.reference,
            "extra": extra}


def _loss_scaler(engine: Engine):
    for name in ("loss_scaler", "scaler"):
        scaler = getattr(engine, name, None)
        if scaler is not None and hasattr(scaler, "state_dict"):
            return scaler
    return None


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
    batch_weight_reference: Optional[float] = None
    compression: Optional[dict] = None  # this rank's error feedback / PowerSGD state
    extra: Optional[dict] = None


def _prepare_load(step_dir: str, engine, optimizer) -> PreparedLoad:
    reader = CheckpointReader(step_dir)
    if engine.comm.rank == 0 and isinstance(reader.index, ManifestIndex):
        reader.check_present()  # format 1: a missing file is reported even if no rank needs it
    check_same_model(reader, engine, optimizer)
    shared = reader.load(SHARED_FILE)
    prepared = PreparedLoad(extra=shared["extra"], loss_scaler=shared["loss_scaler"],
                            batch_weight_reference=shared.get("batch_weight_reference"))
    prepared.buffers = _read_buffers(reader, shared, engine)
    positions = _optimizer_positions(optimizer)
    state: dict[int, dict] = {}
    for bucket in engine.buckets:
        lo, hi = _load_range(bucket)
        prepared.bucket_ranges.append((lo, hi))
        prepared.bucket_values.append(_read_flat(reader, engine, bucket, lo, hi))
        _read_bucket_state(reader, engine, bucket, positions, (lo, hi), state)
    for param in _loose_params(engine):
        name = engine.params.name(param)
        prepared.loose_values[id(param)] = read_range(reader, name, 0, param.numel(), "value")
        if id(param) in positions:
            _put_param_state(reader, engine, param, positions, state)
    prepared.optimizer_state = _optimizer_state_dict(optimizer, shared["param_groups"], state)
    if reader.has_rank_file(engine.comm.rank):  # ranks beyond the saved world keep their RNG
        own = reader.load(f"rank_{engine.comm.rank}.pt")
        prepared.rng, prepared.compression = own["rng"], own.get("compression")
    return prepared



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
        name = engine.params.name(bucket.params[index])
        piece = read_range(reader, name, start, end, "value")
        if out is None:
            out = torch.zeros(hi - lo, dtype=piece.dtype)
        offset = bucket.layout.slots[index].offset
        out[offset + start - lo:offset + end - lo] = piece
    return out if out is not None else torch.zeros(hi - lo)



def _read_bucket_state(reader, engine, bucket, positions, flat_range: tuple[int, int],
                       state: dict[int, dict]) -> None:
    """Optimizer state for this bucket's optimizer tensors (one per fragment, or each parameter)."""
    if bucket.master_pieces:
        for piece in bucket.master_pieces:
            if id(piece.param) in positions:
                name = engine.params.name(bucket.params[piece.slot])
                part = read_state(reader, name, piece.param_start, piece.param_end)
                if part is not None:
                    state[positions[id(piece.param)]] = part.as_state(piece.param.shape)
        return
    for param in bucket.params:
        if id(param) in positions:
            _put_param_state(reader, engine, param, positions, state)


def _put_param_state(reader, engine, param, positions, state: dict[int, dict]) -> None:
    part = read_state(reader, engine.params.name(param), 0, param.numel())
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
    if prepared.batch_weight_reference is not None:
        engine.weights.reference = float(prepared.batch_weight_reference)
    if prepared.rng is not None:
        set_rng_state(prepared.rng)
    if engine.compression is not None:  # restored, or restarted from zero with a warning
        engine.compression.load_state_dict(prepared.compression)


def _write_bucket(bucket, values: torch.Tensor, lo: int, hi: int) -> None:
    """Master (if any) and the compute copy of flat ``[lo, hi)``."""
    if bucket.master is not None:
        bucket.wait_for_master_copy()  # a pinned master may still be read by a device copy
        bucket.master.detach().reshape(-1).copy_(values)
    bucket.write_compute_copy(values, lo, hi)


def _refresh_full_params(engine: Engine, ranges: list[tuple[int, int]]) -> None:
    """Stages 1-2 restored only the owned slices: gather the full parameters like after a step."""
    works = [engine.comm.all_gather(b.full_param, b.fill_own_chunk(), async_op=True)
             for b, (lo, hi) in zip(engine.buckets, ranges)
             if b.full_params_live and (lo, hi) != (0, b.layout.padded_numel)]
    for work in works:
        work.wait()
