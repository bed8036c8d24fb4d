"""Optimizer state in torch's format, and this rank's sharded form of it.

At stages >= 1 the optimizer steps one tensor per parameter *fragment* (a
rank's piece of a parameter, see flat/bucket.py), so its native
``state_dict()`` is keyed by fragment. Three forms meet here:

* the **sharded form**: ``optimizer.state_dict()`` as torch writes it for the
  fragments, plus a ``"shardengine"`` entry naming the layout it belongs to.
  It loads back (``optimizer.load_state_dict``) into the same layout only;
* the **full form**: what a plain torch optimizer over the unwrapped model's
  parameters would write (keyed by position in the original param groups,
  tensors shaped like the parameters). ``full_optimizer_state_dict`` builds it
  (collective); ``optimizer.load_state_dict`` accepts it on every rank,
  each rank slicing out its own fragments, at any stage and world size;
* the checkpoint's per-fragment records (checkpoint.py), for files.
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Any

import torch

from ..errors import ConfigError
from ..state.full_state import gather_slices
from ..engine_api import Engine

FORMAT = "shardengine-sharded-optimizer/1"
# Optimizer state entries that are counters/scalars, not per-element tensors.
SCALAR_STATE_NAMES = frozenset({"step", "eta", "mu"})


def is_elementwise(name: str, value: Any, shape: torch.Size) -> bool:
    return torch.is_tensor(value) and name not in SCALAR_STATE_NAMES and value.shape == shape


def stepped_pieces(engine: Engine) -> list[tuple[Any, Any]]:
    """``(bucket, piece)`` in the optimizer's parameter order."""
    order = {id(piece.param): (bucket, piece) for bucket in engine.buckets for piece in bucket.master_pieces}
    return [order[id(p)] for group in engine.optimizer.param_groups for p in group["params"]]


def _layout(engine: Engine) -> dict:
    pieces = [[engine.params.name(b.params[p.slot]), p.param_start, p.param_end] for b, p in stepped_pieces(engine)]
    return {"format": FORMAT, "world_size": engine.comm.world_size, "rank": engine.comm.rank,
            "shard_group_size": engine.comm.group_size, "stage": engine.spec.stage, "pieces": pieces}


def add_layout_tag(engine: Engine, optimizer, state_dict: dict) -> dict:
    """``state_dict`` post-hook: record which layout the fragments belong to."""
    state_dict["shardengine"] = _layout(engine)
    return state_dict


def from_saved_state(engine: Engine, optimizer, state_dict: dict) -> dict:
    """``load_state_dict`` pre-hook: accept the sharded form of this layout, or the full form."""
    tag = state_dict.get("shardengine")
    if tag is None:
        return _fragments_from_full(engine, state_dict)
    mine = _layout(engine)
    tag = {"shard_group_size": tag.get("world_size"), **tag}  # saved before hybrid sharding: plain
    if tag != mine:
        raise _other_layout(tag, mine)
    return {key: value for key, value in state_dict.items() if key != "shardengine"}


def refuse_sharded_state(engine: Engine, optimizer, state_dict: dict) -> None:
    """Stage 0's ``load_state_dict`` pre-hook: its optimizer is the user's own, over whole
    parameters, so a stage 1-3 state (fragments, tagged) cannot fit it; torch would fail inside
    its step on one rank and leave the others waiting."""
    tag = state_dict.get("shardengine")
    if tag is not None:
        mine = {"rank": engine.comm.rank, "world_size": engine.comm.world_size, "stage": engine.spec.stage,
                "shard_group_size": engine.comm.group_size}
        raise _other_layout({"shard_group_size": tag.get("world_size"), **tag}, mine)


def _other_layout(tag: dict, mine: dict) -> ConfigError:
    return ConfigError(
        f"this optimizer state was saved by rank {tag.get('rank')} of {tag.get('world_size')} at "
        f"stage {tag.get('stage')} (shard groups of {tag.get('shard_group_size')}), a different sharding "
        f"than this rank's (rank {mine['rank']} of {mine['world_size']}, stage {mine['stage']}, shard "
        f"groups of {mine['shard_group_size']}). A sharded optimizer state loads only into "
        "its own layout; save model.full_optimizer_state_dict(optimizer) and load that (any "
        "layout), or use se.save_checkpoint / se.load_checkpoint, which reshard.")


def _fragments_from_full(engine: Engine, full: dict) -> dict:
    """A plain torch optimizer state dict (full tensors) cut down to this rank's fragments."""
    groups = engine.original_groups
    saved_groups = full.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        raise ConfigError(f"the optimizer state dict has {len(saved_groups or [])} param groups, the "
                          f"optimizer given to shard() had {len(groups)}")
    for index, (saved, mine) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(mine):
            raise ConfigError(f"param group {index} of the optimizer state dict has "
                              f"{len(saved['params'])} parameters, the optimizer given to shard() "
                              f"had {len(mine)}")
    by_param = dict(zip((id(p) for p in chain.from_iterable(groups)),
                        chain.from_iterable(g["params"] for g in saved_groups)))
    state = {}
    for index, (bucket, piece) in enumerate(stepped_pieces(engine)):
        param = bucket.params[piece.slot]
        saved = full["state"].get(by_param.get(id(param)))
        if saved:
            state[index] = _cut(saved, param, piece, engine.params.name(param))
    position = 0
    new_groups = []
    for group, saved in zip(engine.optimizer.param_groups, saved_groups):
        count = len(group["params"])
        new_groups.append({**{k: v for k, v in saved.items() if k not in ("params", "param_names")},
                           "params": list(range(position, position + count))})
        position += count
    return {"state": state, "param_groups": new_groups}


def _cut(saved: dict, param: torch.Tensor, piece, name: str) -> dict:
    """``piece``'s part of one parameter's full state. A piece that is the whole parameter (a
    whole-tensor optimizer's) takes every entry as it is (Adafactor's row and column factors)."""
    out = {}
    whole = piece.param_end - piece.param_start == param.numel() and piece.param.shape == param.shape
    for key, value in saved.items():
        if not whole and torch.is_tensor(value) and key not in SCALAR_STATE_NAMES and value.numel() > 1 \
                and value.shape != param.shape:
            raise ConfigError(f"optimizer state {key!r} of {name} has shape {list(value.shape)}, the "
                              f"parameter has {list(param.shape)}")
        if is_elementwise(key, value, param.shape):
            cut = value.detach().reshape(-1)[piece.param_start:piece.param_end]
            out[key] = cut.reshape(piece.param.shape).clone()
        else:
            out[key] = copy.deepcopy(value)
    return out


def full_optimizer_state_dict(engine: Engine, rank0_only: bool = False) -> dict:
    """What a plain torch optimizer over the unwrapped model would return; collective."""
    optimizer = engine.optimizer
    keep = not rank0_only or engine.comm.rank == 0
    if not engine.stepping.rebuilds_optimizer:  # a snapshot, as at stages >= 1: torch's shares the live tensors
        return copy.deepcopy(optimizer.state_dict()) if keep else {}

    positions = {id(p): i for i, p in enumerate(chain.from_iterable(engine.original_groups))}
    local = _local_summary(engine, optimizer, positions)
    every = engine.comm.all_gather_object(local)
    state: dict[int, dict] = {}
    for bucket_index, bucket in enumerate(engine.buckets):
        if bucket.master is None:  # frozen: no optimizer state anywhere
            continue
        # Every rank takes part in the gathers, also one owning no piece of this bucket
        # (owner layout: a rank may own only padding).
        keys = sorted({k for rank_info in every for k in rank_info["tensors"].get(bucket_index, {})})
        for key in keys:
            dtype = next(getattr(torch, info["tensors"][bucket_index][key]) for info in every
                         if key in info["tensors"].get(bucket_index, {}))
            flat = _local_flat(optimizer, bucket, key, dtype)
            if flat.numel() != bucket.layout.padded_numel:
                flat = gather_slices(engine, flat, bucket.layout.padded_numel, bucket.full_param.device)
            if keep:
                _split_into(state, flat, bucket, key, positions)
    if not keep:
        return {}
    stateful = set(chain.from_iterable(info["stateful"] for info in every))
    for info in every:
        for pos, scalars in info["scalars"].items():
            state.setdefault(pos, {}).update(scalars)
    state = {pos: state[pos] for pos in sorted(state) if pos in stateful}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [positions[id(p)] for p in original]}
              for group, original in zip(optimizer.param_groups, engine.original_groups)]
    return {"state": state, "param_groups": groups}


def _local_summary(engine: Engine, optimizer, positions) -> dict:
    """Scalars per parameter position, and element-wise state names and dtypes per bucket."""
    scalars: dict[int, dict] = {}
    tensors: dict[int, dict[str, str]] = {}
    stateful: set[int] = set()
    for bucket_index, bucket in enumerate(engine.buckets):
        for piece in bucket.master_pieces:
            st = optimizer.state.get(piece.param)
            if not st:
                continue
            pos = positions.get(id(bucket.params[piece.slot]))
            if pos is None:
                continue
            stateful.add(pos)
            for key, value in st.items():
                if is_elementwise(key, value, piece.param.shape):
                    tensors.setdefault(bucket_index, {})[key] = str(value.dtype).removeprefix("torch.")
                else:
                    scalars.setdefault(pos, {})[key] = (value.detach().cpu().clone()
                                                        if torch.is_tensor(value) else value)
    return {"scalars": scalars, "tensors": tensors, "stateful": sorted(stateful)}


def _local_flat(optimizer, bucket, key: str, dtype: torch.dtype) -> torch.Tensor:
    """State ``key`` of this rank's pieces laid out like the bucket's master (zeros elsewhere)."""
    flat = torch.zeros(bucket.master.numel(), dtype=dtype, device=bucket.master.device)
    for piece in bucket.master_pieces:
        value = optimizer.state.get(piece.param, {}).get(key)
        if torch.is_tensor(value) and value.shape == piece.param.shape:
            flat[piece.master_start:piece.master_end].copy_(value.detach().reshape(-1))
    return flat


def _split_into(state: dict, flat: torch.Tensor, bucket, key: str, positions) -> None:
    for param, slot in zip(bucket.params, bucket.layout.slots):
        pos = positions.get(id(param))
        if pos is not None:
            state.setdefault(pos, {})[key] = flat[slot.offset:slot.end].view(slot.shape).cpu().clone()


def load_full_optimizer_state_dict(engine: Engine, state_dict: dict) -> None:
    """Load a plain torch optimizer's state dict (or :func:`full_optimizer_state_dict`'s); no collective."""
    engine.optimizer.load_state_dict(state_dict)

