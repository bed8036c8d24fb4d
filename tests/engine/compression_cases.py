"""Rank workers for the engine's compressed communication (tests/engine/test_engine_compression.py).

Each trains the small model of engine_cases.py with a ``compression=`` option
and, in the same process, the same model uncompressed (or the single-process
reference), so a test compares the two runs side by side.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, batch, rel_err
from rank_pool import rank_world
from toy_models import build_model


def _train(spec: dict, options: dict, steps: int) -> tuple[se.model.ShardedModel, list[float]]:
    """``steps`` SGD steps of the spec's model sharded with ``options``; the global-batch losses."""
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=spec.get("lr", 0.2)),
                                stage=spec["stage"], bucket_mb=spec.get("bucket_mb", 25.0), **options)
    b, losses = spec["per_rank_batch"], []
    for step in range(steps):
        ids, targets = batch(spec, step, 0, world)
        loss = F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        summed = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(summed) if world > 1 else None
        losses.append(float(summed) / world)
    return model, losses


def compare_with_uncompressed(spec: dict, compression, steps: int) -> dict:
    """Train compressed and uncompressed side by side; parameters' relative errors and both loss curves."""
    _single_thread()
    options = spec.get("options", {})
    compressed, losses = _train(spec, {**options, "compression": compression}, steps)
    exact, exact_losses = _train(spec, options, steps)
    mine, reference = compressed.full_state_dict(), exact.full_state_dict()
    return {"errors": {k: rel_err(mine[k], reference[k]) for k in reference},
            "losses": losses, "exact_losses": exact_losses,
            "state": mine, "finite": all(bool(torch.isfinite(t).all()) for t in mine.values())}


def stage3_int8_params_keep_masters_exact(spec: dict) -> dict:
    """Stage 3 with int8 parameter gathers: masters equal the model's values; the forward sees
    quantized weights (different, within the block bound) and is the same on every rank."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model({**spec, "buffer": False})
    original = copy.deepcopy(net)
    model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3,
                        compression={"params": "int8", "block_size": spec.get("block_size", 4)})
    ids, _ = batch(spec, 0, 0, world)
    with torch.no_grad():
        out, want = model(ids), original(ids)
    full = model.full_state_dict()
    return {"masters_exact": all(torch.equal(full[k], v) for k, v in original.state_dict().items()),
            "output_diff": float((out - want).abs().max()), "output_scale": float(want.abs().max()),
            "output": out}


def residual_round_trip(spec: dict, path: str, compression) -> dict:
    """A step, a checkpoint, a fresh engine loading it: the carried state must come back."""
    _single_thread()
    model, _ = _train(spec, {"compression": compression}, 2)
    optimizer = model.engine.optimizer
    saved = model.engine.compression.state_dict()
    se.save_checkpoint(path, model, optimizer)
    fresh, _ = _train(spec, {"compression": compression}, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a reset would warn
        se.load_checkpoint(path, fresh, fresh.engine.optimizer)
    loaded = fresh.engine.compression.state_dict()
    other, _ = _train(spec, {"compression": "bf16" if compression != "bf16" else "int8"}, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        se.load_checkpoint(path, other, other.engine.optimizer)
    return {"saved": saved, "loaded": loaded, "state_bytes": model.engine.compression.state_bytes(),
            "reset_warned": any("restarts from zero" in str(w.message) for w in caught)}


def shard_error(options: dict, stage) -> str:
    """The message of the error ``shard()`` raises on every rank (empty if none)."""
    _single_thread()
    net = build_model(dict(vocab=11, dim=7, hidden=[5]))
    try:
        se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage, **options)
    except se.ConfigError as error:
        return str(error)
    return ""
