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
from .writing import (discard_temporary, hold_own_files, prepare_save, publish, remove_directories,
                      remove_set_aside, write_rank_files)

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
    step, holds = _agree(comm, "prepare the save", lambda: prepare_save(path, extra) if comm.rank == 0 else None,
                         from_rank0=True)
    tmp_dir = os.path.join(path, f"{TMP_PREFIX}step_{step}")
    final_dir = os.path.join(path, f"step_{step}")
    try:
        shared = _agree(comm, "write the rank files", lambda: _write_and_hold(path, tmp_dir, final_dir, holds,
                                                                               engine, optimizer, extra))
        aside = _agree(comm, "publish the checkpoint", lambda: publish(
            path, tmp_dir, final_dir, build_manifest(engine, optimizer, shared), keep, holds)
            if comm.rank == 0 else None, from_rank0=True)
    except CheckpointError:
        if comm.rank == 0:  # every rank is past its writes (the failure was agreed on)
            discard_temporary(tmp_dir)
        raise
    # What the save replaced or pruned: each rank its own files, then rank 0 the rest (writing.py).
    _agree(comm, "remove the replaced checkpoints", lambda: remove_set_aside(path, aside, comm.rank))
    if comm.rank == 0:
        remove_directories(path, aside)
    return final_dir


def _write_and_hold(path: str, tmp_dir: str, final_dir: str, holds: bool, engine, optimizer, extra):
    shared = write_rank_files(tmp_dir, engine, optimizer, extra)
    if holds:  # re-saving the published step: keep it published meanwhile (writing.py)
        hold_own_files(path, os.path.basename(final_dir), engine.comm.rank)
    return shared


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
    step_dir = _agree(comm, "find the checkpoint", lambda: resolve_checkpoint(path) if comm.rank == 0 else None,
                      from_rank0=True)
    prepared: list[PreparedLoad] = []
    _agree(comm, f"read {step_dir}", lambda: prepared.append(_prepare_load(step_dir, engine, optimizer)))
    _apply(prepared[0], engine, optimizer)
    return prepared[0].extra


# =========================================================================== agreement


def _agree(comm, what: str, action: Callable[[], Any], from_rank0: bool = False) -> Any:
    """Run ``action`` on every rank; return its result (rank 0's, with ``from_rank0``), or raise everywhere.

    Agreeing on the outcome is also the barrier between phases, so a failure on
    one rank stops all of them at the same point instead of leaving the others
    in a collective the failed rank never reaches. It costs every rank the same
    whatever N: one all-reduce of a count (and a broadcast of rank 0's result);
    only when a rank failed are the messages gathered.
    """
    try:
        result, failure = action(), None
    except Exception as error:  # noqa: BLE001 - reported to every rank below
        result = None
        failure = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    if comm.count_true(failure is not None):
        failures = [(rank, text) for rank, text in enumerate(comm.all_gather_object(failure)) if text is not None]
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
        raise CheckpointError(f"checkpoint: could not {what} ({detail})")
    return comm.broadcast_object(result) if from_rank0 else result


def _engine_of(model: nn.Module):
    engine = getattr(model, "engine", None)  # ShardedModel.engine: the typed view (engine_api.py)
    if engine is None:
        raise TypeError(f"expected the model returned by shardengine.shard(), got {type(model).__name__}")
    return engine
