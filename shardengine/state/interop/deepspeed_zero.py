"""A DeepSpeed ZeRO-1/2/3 checkpoint as full, name-keyed training state (no DeepSpeed, no process group).

``deepspeed_training_state(folder)`` returns the layout torchtitan saves and
:func:`shardengine.interop.load_training_state` loads at any world size and stage::

    {"model": {name: fp32 tensor},                       # the fp32 master weights (and buffers)
     "optimizer": {"state": {name: {"step", "exp_avg", "exp_avg_sq", ...}},
                   "param_groups": [{hyperparameters..., "params": [names]}]},
     "lr_scheduler": {...},                              # when DeepSpeed saved one
     "step": global_steps}

[Note: DeepSpeed's flat layouts, as zero_to_fp32 reads them]
ZeRO-1/2 flatten each param group (parameters in ``param_shapes`` order, each followed
by its ``param_alignment_paddings`` entry) into one buffer split in equal partitions;
rank r's optimizer file holds partition r (``single_partition_of_fp32_groups``), the
last one without its padding, and the base optimizer's state for it, element for
element. ZeRO-3 instead splits every parameter on its own: rank r holds elements
``[r*ceil(n/N), (r+1)*ceil(n/N))`` of each, back to back in ``param_shapes`` order,
over one or more sub-groups (``fp32_flat_groups``), with the optimizer state per
sub-group laid out the same way. Scalar state (``step``) is one per flat group.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import CheckpointError
from .deepspeed_files import (MODEL_FILE, OPTIM_FILE, attribute, check_no_model_parallel, load_file,
                              ranked_files, resolve_step_dir)


def deepspeed_training_state(checkpoint: str, tag: Optional[str] = None) -> dict:
    """The full training state in a DeepSpeed ZeRO-1/2/3 checkpoint folder (see the module docstring).

    ``checkpoint`` is the folder given to DeepSpeed's ``engine.save_checkpoint`` (its
    ``latest`` is followed; ``tag`` picks another ``global_step*``) or a ``global_step*``
    folder. Only ``torch.load(weights_only=True)`` is used; DeepSpeed need not be installed.
    Memory: the fp32 weights and each optimizer state in full, as one process holds them.
    """
    step_dir = resolve_step_dir(checkpoint, tag)
    check_no_model_parallel(step_dir)
    model_files = ranked_files(step_dir, MODEL_FILE)
    optim_files = ranked_files(step_dir, OPTIM_FILE)
    if not model_files or not optim_files:
        raise CheckpointError(f"{step_dir}: a DeepSpeed ZeRO checkpoint has *_model_states.pt and "
                              f"*_optim_states.pt files; found {len(model_files)} and {len(optim_files)} "
                              "(a checkpoint without ZeRO, or saved with save_checkpoint(..., exclude_"
                              "frozen_parameters) elsewhere?)")
    model_state = load_file(model_files[0])
    optim = [load_file(path)["optimizer_state_dict"] for path in optim_files]
    zero_stage = int(attribute(optim[0], "zero_stage", 1 if "single_partition_of_fp32_groups" in optim[0] else -1))
    shapes = [dict(group) for group in model_state["param_shapes"]]
    if zero_stage not in _READERS:
        raise CheckpointError(f"{step_dir}: ZeRO stage {zero_stage} is not a stage this reader knows "
                              f"({', '.join(map(str, sorted(_READERS)))})")
    read, per_rank_model_files = _READERS[zero_stage]
    weights, state, hyper = read(step_dir, optim, shapes)
    model = _model_entries(step_dir, model_state, [load_file(f) for f in model_files] if per_rank_model_files
                           else [model_state], weights, len(optim))
    groups = [{**group, "params": list(names)} for group, names in zip(hyper, shapes)]
    for group in groups:
        _step_into_state(group, state)
    result = {"model": model, "optimizer": {"state": state, "param_groups": groups},
              "step": int(model_state.get("global_steps", 0))}
    if model_state.get("lr_scheduler") is not None:
        result["lr_scheduler"] = model_state["lr_scheduler"]
    return result


# =========================================================================== ZeRO-1/2


def _zero12(step_dir: str, optim: list[dict], shapes: list[dict]):
    """Per-parameter fp32 weights, optimizer state and group hyperparameters of ZeRO-1/2 files."""
    paddings = optim[0].get("param_alignment_paddings") or [[0] * len(group) for group in shapes]
    bases = [rank["base_optimizer_state"] for rank in optim]
    weights, state, hyper = {}, {}, []
    for g, group in enumerate(shapes):
        parts = [rank["single_partition_of_fp32_groups"][g] for rank in optim]
        flat = torch.cat([p.reshape(-1) for p in parts])
        flat_state = _flat_state([base["state"].get(g, {}) for base in bases], [p.numel() for p in parts],
                                 f"{step_dir}: param group {g}")
        offset = 0
        for (name, shape), padding in zip(group.items(), paddings[g]):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise CheckpointError(f"{step_dir}: param group {g} holds {flat.numel()} elements, fewer than "
                                      "its param_shapes name; the files do not belong together")
            weights[name] = flat[offset:offset + numel].view(shape)
            state[name] = {key: (value[offset:offset + numel].view(shape) if torch.is_tensor(value)
                                 and value.dim() == 1 and value.numel() == flat.numel() else _own(value))
                           for key, value in flat_state.items()}
            offset += numel + padding
        align = 2 * len(optim)  # DeepSpeed pads each group to a multiple of 2N (zero_to_fp32's check)
        if align * math.ceil(offset / align) != align * math.ceil(flat.numel() / align):
            raise CheckpointError(f"{step_dir}: param group {g}'s parameters take {offset} elements, its "
                                  f"partitions hold {flat.numel()}; the files do not belong together")
        hyper.append(_hyperparameters(bases[0]["param_groups"][g]))
    return weights, state, hyper


# =========================================================================== ZeRO-3


def _zero3(step_dir: str, optim: list[dict], shapes: list[dict]):
    """Per-parameter fp32 weights, optimizer state and group hyperparameters of ZeRO-3 files."""
    world = len(optim)
    flats = [torch.cat([t.reshape(-1) for t in rank["fp32_flat_groups"]]) for rank in optim]
    bases = [rank["optimizer_state_dict"] for rank in optim]
    sub_sizes = [t.numel() for t in optim[0]["fp32_flat_groups"]]
    per_rank_state = [_flat_state([base["state"].get(k, {}) for k in range(len(sub_sizes))], sub_sizes,
                                  f"{step_dir}: rank {r}") for r, base in enumerate(bases)]
    weights, state, hyper = {}, {}, []
    offset = 0
    for group in shapes:
        sub = _sub_group_at(offset, sub_sizes)
        hyper.append(_hyperparameters(bases[0]["param_groups"][sub]))
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if offset + part > flats[0].numel():
                raise CheckpointError(f"{step_dir}: rank 0's partitions hold {flats[0].numel()} elements, fewer "
                                      "than its param_shapes need; the files do not belong together")
            weights[name] = torch.cat([f[offset:offset + part] for f in flats])[:numel].view(shape)
            state[name] = {}
            for key, value in per_rank_state[0].items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flats[0].numel():
                    full = torch.cat([rank_state[key][offset:offset + part] for rank_state in per_rank_state])
                    state[name][key] = full[:numel].view(shape)
                else:
                    state[name][key] = _own(value)
            offset += part
    if offset != flats[0].numel():
        raise CheckpointError(f"{step_dir}: the parameters take {offset} elements of each rank's partition, "
                              f"which holds {flats[0].numel()}; the files do not belong together")
    return weights, state, hyper


# DeepSpeed's ZeRO stage of a checkpoint -> (the reader of its optimizer files, whether each
# rank's model file holds that rank's frozen partitions: ZeRO-3 partitions every parameter).
_READERS = {1: (_zero12, False), 2: (_zero12, False), 3: (_zero3, True)}


def _sub_group_at(offset: int, sizes: list[int]) -> int:
    """The ZeRO-3 sub-group (a flat group of at most ``sub_group_size`` elements) holding ``offset``."""
    end = 0
    for index, size in enumerate(sizes):
        end += size
        if offset < end:
            return index
    return len(sizes) - 1


# =========================================================================== shared


def _flat_state(states: list[dict], sizes: list[int], where: str) -> dict:
    """The base optimizer's state over several flat pieces, joined: element-wise entries concatenated
    (each cut to its piece's size), scalars (``step``) taken from the first piece."""
    if not states or not states[0]:
        return {}
    joined = {}
    for key, value in states[0].items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == sizes[0]:
            # the last rank's fp32 partition is saved without its padding, its state with it
            pieces = [state[key].reshape(-1) for state in states]
            if any(p.numel() < size for p, size in zip(pieces, sizes)):
                raise CheckpointError(f"{where}: optimizer state {key!r} has {[p.numel() for p in pieces]} "
                                      f"elements where the fp32 partitions have {sizes}")
            joined[key] = torch.cat([p[:size] for p, size in zip(pieces, sizes)])
        else:
            joined[key] = value.clone() if torch.is_tensor(value) else value
    return joined


def _step_into_state(group: dict, state: dict) -> None:
    """DeepSpeed's ``FusedAdam`` counts steps in its param group, torch's optimizers per parameter
    (``state["step"]``): moved there, or a torch AdamW resuming would restart its bias correction."""
    if "step" not in group:
        return
    step = group.pop("step")
    for name in group["params"]:
        if state.get(name) and "step" not in state[name]:
            state[name]["step"] = torch.tensor(float(step))


def _own(value):
    """A parameter's own copy of a per-group scalar: torch's optimizers step ``state["step"]`` in place,
    so one tensor shared by several parameters would count each step once per parameter."""
    return value.clone() if torch.is_tensor(value) else value


def _hyperparameters(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def _model_entries(step_dir: str, model_state: dict, rank_states: list[dict], weights: dict,
                   world: int) -> dict:
    """Trainable weights, frozen ones, buffers and tied names, in the module's ``state_dict`` order."""
    out = dict(weights)
    out.update(_frozen(step_dir, rank_states, world))
    module = model_state.get("module") or {}
    buffers = set(model_state.get("buffer_names") or [])
    for name, source in (model_state.get("shared_params") or {}).items():
        if source in out:
            out[name] = out[source]
    ordered = {key: (out[key] if key in out else module[key].float() if module[key].is_floating_point()
                     else module[key])
               for key in module if key in out or key in buffers}
    ordered.update({key: value for key, value in out.items() if key not in ordered})
    return ordered


def _frozen(step_dir: str, rank_states: list[dict], world: int) -> dict:
    """Frozen parameters: whole in the one model file (ZeRO-1/2), per-rank fragments at ZeRO-3."""
    shapes = rank_states[0].get("frozen_param_shapes") or {}
    out = {}
    for name, shape in shapes.items():
        fragments = [(state.get("frozen_param_fragments") or {}).get(name) for state in rank_states]
        if any(f is None for f in fragments):
            raise CheckpointError(f"{step_dir}: frozen parameter {name} has no saved values (DeepSpeed saved "
                                  "with exclude_frozen_parameters=True?); load it from the base model")
        numel = math.prod(shape)
        flat = torch.cat([f.reshape(-1) for f in fragments])[:numel] if len(fragments) > 1 else \
            fragments[0].reshape(-1)[:numel]
        out[name] = flat.float().view(shape) if flat.is_floating_point() else flat.view(shape)
    return out
