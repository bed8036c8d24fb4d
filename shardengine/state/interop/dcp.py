"""Sharded runs to and from torch DCP checkpoints in FSDP2's / torchtitan's layout.

``load_dcp_checkpoint`` resumes from ``{"model": ..., "optimizer": ...}`` saved with
``get_model_state_dict`` / ``get_optimizer_state_dict`` + ``dcp.save`` (FSDP2,
torchtitan, torchtune) at any world size; ``save_dcp_checkpoint`` writes the same
layout, which ``dcp.load`` into an FSDP2 model and optimizer reads. See
[Note: one process reads or writes the whole DCP folder] in distributed/dcp_files.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...distributed.dcp_files import read_dcp, write_dcp
from ...errors import ConfigError
from ..checkpoint import _agree, _engine_of
from .named_state import TRAINING_STATE_KEYS, load_training_state, named_optimizer_state


def load_dcp_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore ``model`` and ``optimizer`` from the DCP folder ``path`` (FSDP2 / torchtitan layout).

    Every rank reads the folder whole (no collective) and keeps its own slices, so
    the checkpoint may come from any world size. Returns the folder's other entries
    (e.g. ``lr_scheduler``, ``dataloader``, ``train_state``), for the caller to apply.
    """
    return load_training_state(model, optimizer, read_dcp(path))


def save_dcp_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                        extra: Optional[dict] = None) -> str:
    """Write ``{"model", "optimizer", **extra}`` as a DCP folder FSDP2 loads; collective.

    ``dcp.load({"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, opt)},
    checkpoint_id=path)`` then ``set_model_state_dict`` / ``set_optimizer_state_dict``
    restores an FSDP2 run at any world size. The model and optimizer state are gathered
    in full (rank 0 writes); ``extra`` holds tensors and plain values. Returns ``path``.
    """
    engine = _engine_of(model)
    clash = sorted(set(extra or {}) & set(TRAINING_STATE_KEYS))
    if clash:
        raise ConfigError(f"save_dcp_checkpoint: extra may not hold {clash}; those entries are the model's "
                          "and the optimizer's")
    model_state = model.state_dict()
    optimizer_state = model.full_optimizer_state_dict(optimizer, rank0_only=True)
    if isinstance(optimizer_state, list):  # the same answer on every rank
        raise ConfigError("save_dcp_checkpoint: an OptimizerList has no single torch optimizer state dict "
                          "for FSDP2 to load; use se.save_checkpoint, or export each optimizer's state")
    comm = engine.comm

    def write() -> None:
        if comm.rank == 0:
            state = {"model": model_state, "optimizer": named_optimizer_state(engine, optimizer_state)}
            write_dcp({**state, **(extra or {})}, path)

    _agree(comm, f"write the DCP checkpoint {path}", write)
    return path
