"""Lightning checkpoints under ShardStrategy: a sharded directory, and its one-file export.

A checkpoint path Lightning names (``epoch=1-step=20.ckpt``) becomes a
directory written by :func:`shardengine.save_checkpoint` (each rank its
shard, atomic, loadable at another world size and stage). What Lightning adds
to a checkpoint besides the weights and optimizer state (loops, callbacks,
schedulers, hyperparameters, versions) travels in the engine checkpoint's
``extra`` as one serialized blob, so it is published atomically with the
shards and covered by the manifest's sha256.

``consolidate_checkpoint(CKPT_DIR, OUT)`` turns such a directory into an
ordinary Lightning ``.ckpt`` file (no process group needed), which
``LitModel.load_from_checkpoint(OUT)`` and any ``Trainer`` load::

    python -m shardengine.integrations.lightning.consolidate CKPT_DIR model.ckpt
"""

from __future__ import annotations

import io
import os
from typing import Any, Optional

import torch

from shardengine.state.checkpoint import SHARED_FILE, CheckpointReader, resolve_checkpoint
from shardengine.state.consolidate import consolidated_state_dict

from .step_module import strip_prefix

LIGHTNING_KEY = "lightning_checkpoint"   # the blob's key in the engine checkpoint's ``extra``
ENGINE_ONLY = ("state_dict", "optimizer_states")  # held by the engine's shards, not in the blob


def pack(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The engine's ``extra`` for Lightning's checkpoint dict (weights and optimizer left out)."""
    rest = {key: value for key, value in checkpoint.items() if key not in ENGINE_ONLY}
    buffer = io.BytesIO()
    torch.save(rest, buffer)
    blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    step = checkpoint.get("global_step")
    return {"step": int(step) if isinstance(step, int) else None, LIGHTNING_KEY: blob}


def unpack(extra: Optional[dict], path: str, weights_only: Optional[bool]) -> dict[str, Any]:
    """Lightning's checkpoint dict (without weights) from the engine checkpoint's ``extra``."""
    if not isinstance(extra, dict) or LIGHTNING_KEY not in extra:
        raise ValueError(f"{path} is a shardengine checkpoint but not one written by ShardStrategy "
                         "(no Lightning state in it); load it with shardengine.load_checkpoint")
    data = extra[LIGHTNING_KEY].numpy().tobytes()
    kwargs = {} if weights_only is None else {"weights_only": weights_only}
    checkpoint = torch.load(io.BytesIO(data), map_location="cpu", **kwargs)
    # the keys Lightning checks before restoring; the engine already restored what they hold
    checkpoint.setdefault("state_dict", {})
    checkpoint.setdefault("optimizer_states", [])
    return checkpoint


def is_engine_checkpoint(path: str) -> bool:
    """A directory written by ``shardengine.save_checkpoint`` (not a one-file .ckpt)."""
    return os.path.isdir(path)


def read_offline(path: str, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's full checkpoint dict from a ShardStrategy directory, with no process group:
    the LightningModule's state dict under its own keys, and no optimizer state."""
    step_dir = resolve_checkpoint(path)
    extra = CheckpointReader(step_dir).load(SHARED_FILE).get("extra")
    checkpoint = unpack(extra, path, weights_only)
    checkpoint["state_dict"] = strip_prefix(consolidated_state_dict(step_dir))
    checkpoint["optimizer_states"] = []
    return checkpoint


def consolidate_checkpoint(path: str, out: str, weights_only: Optional[bool] = None) -> str:
    """Write ShardStrategy's checkpoint directory ``path`` as one Lightning ``.ckpt`` file ``out``.

    Reads one rank file at a time; the result holds the full weights (fp32 masters
    under mixed precision) and Lightning's own state, but no optimizer state.

    >>> consolidate_checkpoint("checkpoints/epoch=0-step=8.ckpt", "model.ckpt")  # doctest: +SKIP
    'model.ckpt'
    >>> LitModel.load_from_checkpoint("model.ckpt")                               # doctest: +SKIP
    """
    checkpoint = read_offline(path, weights_only)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    partial = out + ".partial"
    torch.save(checkpoint, partial)
    os.replace(partial, out)
    return out
