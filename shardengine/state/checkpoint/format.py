"""What a checkpoint directory holds: its file names, the manifest, and the model described in it.

Layout of a checkpoint directory::

    ckpt/latest                 "step_200"
    ckpt/step_200/manifest.json world size, stage, params, layout, shared.pt's sha256 (rank 0)
    ckpt/step_200/rank_<r>.pt   rank r's fragments and RNG states
    ckpt/step_200/rank_<r>.json rank_<r>.pt's size, sha256 and index of fragments (rank r)
    ckpt/step_200/shared.pt     buffers, param-group hyperparameters, loss scaler, extra

The manifest's size depends on the model, not on the world size (index.py, [Note:
nothing on rank 0 grows with the world size]); format 1 listed every rank's files
and fragments in it, and is still read.

Every file holds tensors and plain data only, and is read with
``torch.load(weights_only=True)``: loading a checkpoint never runs code from
it. Paths are confined: ``latest`` names a step directory inside the
checkpoint directory, the manifest names files inside the step directory.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import sys
from typing import Any, Optional

import torch
from torch import nn

from ...policies import dtype_name
from ...errors import CheckpointError
from ...engine_api import Engine

FORMAT = "shardengine-universal/2"
FORMATS = ("shardengine-universal/1", FORMAT)  # what a reader accepts (1: every rank's index in the manifest)
MANIFEST = "manifest.json"
LATEST = "latest"
SHARED_FILE = "shared.pt"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp_"            # .tmp_step_<k>: a save being written
OLD_PREFIX = ".old_"            # .old_step_<k>: a replaced step directory being deleted
PREVIOUS_SUFFIX = ".previous"   # step_<k>.previous: step_<k>, kept published while it is replaced
PUBLISHED_DIR = re.compile(r"^step_(\d+)(\.previous)?$")  # what ``latest`` may name
DATA_FILE = re.compile(r"^(rank_\d+\.pt|shared\.pt)$")      # what the manifest may name
# Optimizer state entries that are counters/scalars, not per-element tensors.
SCALAR_STATE_NAMES = frozenset({"step", "eta", "mu"})


# =========================================================================== paths


def latest_target(root: str) -> Optional[str]:
    """What ``root/latest`` holds (unchecked), or None when there is no pointer."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        return f.read().strip()


def read_json(path: str, if_missing: str) -> Any:
    """The JSON document at ``path``, or a CheckpointError (``if_missing``: what its absence means)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({if_missing})") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from error


def check_inside(path: str, directory: str, what: str) -> None:
    """``path`` (symbolic links resolved) must lie inside ``directory``."""
    real, base = os.path.realpath(path), os.path.realpath(directory)
    if os.path.commonpath([real, base]) != base:
        raise CheckpointError(f"{path}: {what} leads outside {directory} (to {real}); refusing to read it")


# =========================================================================== plain data

# What ``torch.load(weights_only=True)`` reads back; containers are checked element by element.
_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
                 torch.Tensor, nn.Parameter)
_PLAIN_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set)


def check_plain_data(value: Any, where: str) -> None:
    """Raise a CheckpointError naming the first part of ``value`` that is not plain data."""
    kind = type(value)
    if kind in _PLAIN_VALUES:
        return
    if kind in (dict, collections.OrderedDict):
        for key, item in value.items():
            check_plain_data(key, f"a key of {where}")
            check_plain_data(item, f"{where}[{key!r}]")
        return
    if kind in _PLAIN_CONTAINERS:
        for index, item in enumerate(value):
            check_plain_data(item, f"{where}[{index}]")
        return
    raise CheckpointError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: a checkpoint stores plain data only "
        "(None, bool, int, float, str, bytes, lists, tuples, sets, dicts, tensors), so that loading "
        "it never unpickles code (torch.load(weights_only=True)). Store the object's state_dict(), "
        "or a number (.item()) or list (.tolist()) instead")


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


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dtype


def sha256_of(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# =========================================================================== manifest


def build_manifest(engine: Engine, optimizer: torch.optim.Optimizer, shared: dict) -> dict:
    """The manifest of a checkpoint of ``engine`` (rank 0); ``shared``: shared.pt's size and sha256.
    Nothing in it grows with the world size (index.py)."""
    keys = param_keys(engine.module)
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    value_dtype = _value_dtypes(engine)
    params = [{"name": name, "keys": keys.get(id(p), [name]), "shape": list(p.shape),
               "dtype": dtype_name(value_dtype.get(id(p), p.dtype)), "compute_dtype": dtype_name(p.dtype),
               "requires_grad": p.requires_grad}
              for name, p in engine.module.named_parameters()]
    return {
        "format": FORMAT,
        "world_size": engine.comm.world_size,
        "shard_group_size": engine.comm.group_size,
        "stage": engine.spec.stage,
        "versions": {"torch": torch.__version__, "shardengine": _package_version(),
                     "python": sys.version.split()[0]},
        "params": params,
        "state_dict_keys": list(engine.module.state_dict(keep_vars=True)),
        "buffers": {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)}
                    for k, v in buffer_entries(engine.module).items() if torch.is_tensor(v)},
        "optimizer": {"class": optimizer_class_name(optimizer), "param_groups": len(optimizer.param_groups),
                      # the parameters of each group given to shard(), in order: what a plain
                      # torch optimizer's state_dict keys by position (consolidate --optimizer)
                      "param_names": [[engine.params.name(p) for p in group]
                                      for group in engine.original_groups]},
        "layout": [{"params": [engine.params.name(p) for p in b.params],
                    "slots": [[s.offset, s.numel] for s in b.layout.slots],
                    "padded_numel": b.layout.padded_numel, "shard_numel": b.layout.shard_numel,
                    "group_index": group_of.get(id(b.params[0]), b.group_index),
                    "requires_grad": b.requires_grad}
                   for b in engine.buckets],
        "files": {SHARED_FILE: shared},
        "rank_files": engine.comm.world_size,  # rank_<r>.pt and rank_<r>.json for r < world_size
        "model_config": model_config(engine.module),
    }


def model_config(module: nn.Module) -> Optional[dict]:
    """A Hugging Face module's config (and generation config) as plain JSON data; None otherwise.

    [Note: recorded config] ``python -m shardengine.consolidate CKPT OUT --format hf`` turns
    a checkpoint into a ``from_pretrained`` folder; with the config in the manifest it needs
    no ``--config``. Duck-typed (``to_json_string``): the core never imports transformers.
    """
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    try:
        data = json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):  # a config that does not serialize: consolidate asks for --config
        return None
    data["architectures"] = [type(module).__name__]  # what save_pretrained records
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    generation_data = None
    if generation is not None and callable(can_generate) and can_generate():
        try:
            generation_data = json.loads(generation.to_json_string(use_diff=True))
        except (TypeError, ValueError):
            generation_data = None
    return {"config": data, "generation_config": generation_data}


def _value_dtypes(engine: Engine) -> dict[int, torch.dtype]:
    """``id(param) -> dtype of its saved values``: the master's (fp32 under mixed precision)."""
    return {id(p): b.master.dtype for b in engine.buckets if b.master is not None for p in b.params}


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("shardengine")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The class name checkpoints record: ``OptimizerList[Muon, AdamW]`` for a list (its
    ``class_name``; read by attribute so that state/ does not import optim/)."""
    return getattr(optimizer, "class_name", type(optimizer).__name__)
