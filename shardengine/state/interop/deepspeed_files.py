"""Opening a DeepSpeed ZeRO checkpoint folder without DeepSpeed: its files, and unpickling them safely.

A DeepSpeed checkpoint folder::

    ds/latest                                         "global_step200"
    ds/global_step200/mp_rank_00_model_states.pt      module, param_shapes, lr_scheduler, ... (ZeRO-1/2)
    ds/global_step200/zero_pp_rank_<r>_mp_rank_00_model_states.pt   the same, one per rank (ZeRO-3)
    ds/global_step200/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's fp32 partition + Adam state

[Note: reading DeepSpeed's pickles without DeepSpeed]
DeepSpeed pickles three of its own classes into these files (``ZeroStageEnum``,
``LossScaler``, ``fragment_address``). shardengine never imports DeepSpeed, and a
checkpoint is read with ``torch.load(weights_only=True)``, which runs no code from the
file: stand-ins registered under DeepSpeed's module paths are allowed as the only
non-torch globals. A file holding anything else is refused with the class it names.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from ...errors import CheckpointError

LATEST = "latest"
STEP_DIR = re.compile(r"^global_step\d+$")
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
MODEL_PARALLEL_FILE = re.compile(r"mp_rank_(?!00_)\d+|^layer_\d+")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_00_model_states\.pt$")


def _stand_in(module: str, name: str, cls: type) -> type:
    cls.__module__, cls.__qualname__, cls.__name__ = module, name, name
    return cls


class _ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` (an ``int`` enum): unpickled as the stage number."""

    def __new__(cls, value: int = 0):
        return super().__new__(cls, value)


class _LossScaler:
    """DeepSpeed's ``LossScaler`` (its attributes only; the loss scale of an fp16 run)."""


class _FragmentAddress:
    """DeepSpeed's ``fragment_address`` (``numel``, ``start``: where a parameter sits in a partition)."""

_STAND_INS = [
    _stand_in("deepspeed.runtime.zero.config", "ZeroStageEnum", _ZeroStage),
    _stand_in("deepspeed.runtime.fp16.loss_scaler", "LossScaler", _LossScaler),
    _stand_in("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", type("DynamicLossScaler", (_LossScaler,), {})),
    _stand_in("deepspeed.utils.tensor_fragment", "fragment_address", _FragmentAddress),
]


def load_file(path: str) -> dict:
    """One DeepSpeed ``*.pt`` file, memory-mapped, unpickled without running code from it."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - reported with the file and what to do
        raise CheckpointError(
            f"{path}: cannot be read as a DeepSpeed checkpoint file without running code from it "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Objects other than "
            "tensors and DeepSpeed's ZeroStageEnum / LossScaler / fragment_address are refused; save the "
            "checkpoint without custom client state, or consolidate it with DeepSpeed's zero_to_fp32.py") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a dict, found a {type(value).__name__}")
    return value


def resolve_step_dir(path: str, tag: Optional[str] = None) -> str:
    """The ``global_step*`` folder to read: ``path/tag``, ``path/<latest>``, or ``path`` itself."""
    if tag is not None:
        step_dir = os.path.join(path, tag)
    elif os.path.isfile(os.path.join(path, LATEST)):
        with open(os.path.join(path, LATEST)) as f:
            step_dir = os.path.join(path, f.read().strip())
    else:
        step_dir = path
    name = os.path.basename(os.path.normpath(step_dir))
    if tag is None and not STEP_DIR.match(name) and not any(MODEL_FILE.match(f) for f in _listing(step_dir)):
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint folder (no '{LATEST}' file and no "
                              "*_model_states.pt); pass the folder given to engine.save_checkpoint() "
                              "or one of its global_step* folders")
    real, base = os.path.realpath(step_dir), os.path.realpath(path)
    if os.path.commonpath([real, base]) != base:
        raise CheckpointError(f"{path}/{LATEST} leads outside {path} (to {real}); refusing to read it")
    if not os.path.isdir(step_dir):
        raise CheckpointError(f"{step_dir}: no such DeepSpeed checkpoint folder")
    return step_dir


def ranked_files(step_dir: str, pattern: re.Pattern) -> list[str]:
    """The files of ``step_dir`` matching ``pattern``, in rank order (group 1 is the rank)."""
    found = [(int(m.group(1) or 0), name) for name in _listing(step_dir) if (m := pattern.match(name))]
    found.sort()
    ranks = [rank for rank, _ in found]
    if ranks != list(range(len(ranks))):
        raise CheckpointError(f"{step_dir}: the rank files present are {ranks}; ranks 0..{len(ranks) - 1} "
                              "are needed (a save interrupted, or files missing?)")
    return [os.path.join(step_dir, name) for _, name in found]


def check_no_model_parallel(step_dir: str) -> None:
    """Refuse tensor- or pipeline-parallel checkpoints (``mp_rank_01``..., ``layer_*``): their
    parameters are split in ways a ZeRO layout does not describe; reading mp_rank_00 alone
    would return part of the model."""
    other = [name for name in _listing(step_dir) if MODEL_PARALLEL_FILE.search(name)]
    if other:
        raise CheckpointError(f"{step_dir}: holds tensor- or pipeline-parallel files ({other[0]}, ...); only "
                              "data-parallel ZeRO checkpoints (files of mp_rank_00 only) can be converted; merge the "
                              "tensor or pipeline parallel parts with DeepSpeed's own tools first")


def _listing(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def attribute(value: Any, name: str, default: Any = None) -> Any:
    """``value[name]`` for a dict, ``value.name`` for an unpickled object."""
    if isinstance(value, dict):
        return value.get(name, default)
    return getattr(value, name, default)
