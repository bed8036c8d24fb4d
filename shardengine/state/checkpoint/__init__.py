"""Sharded, atomic, reshardable checkpoints: ``save_checkpoint`` / ``load_checkpoint``.

The package, by concept: ``format`` (file names, manifest), ``engine_state``
(the engine's values and optimizer state to and from records: the universal
format), ``writing`` (rank files, publishing atomically), ``reading`` (finding
and verifying a checkpoint, reading ranges), ``rng``. This module holds the
two collective entry points, which run each phase on every rank and agree on
its outcome.

[Note: nothing loads partially]
Loading reads and verifies everything first (manifest, layout, sizes,
sha256) into new tensors, then the ranks agree (``all_gather_object``) that
every one of them succeeded, and only then are the model, the optimizer and
the RNGs written. Errors are raised on every rank, so no rank is left waiting
in a collective.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from torch import nn

from .engine_state import PreparedLoad, _apply, _prepare_load
from .format import LATEST, MANIFEST, SHARED_FILE, TMP_PREFIX, build_manifest, dtype_from_name
from ...errors import CheckpointError
from .reading import CheckpointReader, latest_checkpoint, read_state, resolve_checkpoint
from .writing import discard_temporary, prepare_save, publish, write_rank_files

__all__ = ["CheckpointError", "CheckpointReader", "LATEST", "MANIFEST", "SHARED_FILE", "dtype_from_name",
           "latest_checkpoint", "load_checkpoint", "read_state", "resolve_checkpoint", "save_checkpoint"]


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
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 (or None to keep all), got {keep!r}")
    comm = engine.comm
    engine.calls.announce(engine, "se.save_checkpoint()")  # collective: no rank may skip it
    step = _agree(comm, "prepare the save", lambda: prepare_save(path, extra) if comm.rank == 0 else None)[0]
    tmp_dir = os.path.join(path, f"{TMP_PREFIX}step_{step}")
    final_dir = os.path.join(path, f"step_{step}")
    try:
        entries = _agree(comm, "write the rank files",
                         lambda: write_rank_files(tmp_dir, engine, optimizer, extra))
        _agree(comm, "publish the checkpoint", lambda: publish(
            path, tmp_dir, final_dir, build_manifest(engine, optimizer, entries), keep)
            if comm.rank == 0 else None)
    except CheckpointError:
        if comm.rank == 0:  # every rank is past its writes (the failure was agreed on)
            discard_temporary(tmp_dir)
        raise
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
    engine.calls.announce(engine, "se.load_checkpoint()")  # collective: no rank may skip it
    step_dir = _agree(comm, "find the checkpoint",
                      lambda: resolve_checkpoint(path) if comm.rank == 0 else None)[0]
    prepared: list[PreparedLoad] = []
    _agree(comm, f"read {step_dir}", lambda: prepared.append(_prepare_load(step_dir, engine, optimizer)))
    _apply(prepared[0], engine, optimizer)
    return prepared[0].extra


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
    engine = getattr(model, "engine", None)  # ShardedModel.engine: the typed view (engine_api.py)
    if engine is None:
        raise TypeError(f"expected the model returned by shardengine.shard(), got {type(model).__name__}")
    return engine
