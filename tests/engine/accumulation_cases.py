"""Rank workers for gradient accumulation in the orders users write it.

Each step runs ``len(spec["sizes"][step])`` micro-batches; rank r's part of
micro-batch m has ``sizes[step][m][r]`` samples (uneven when they differ) and a
loss that is a sum over its samples divided by its size and by the number of
micro-steps (the usual accumulation recipe). The reference is one process on
the union of every rank's samples of the step, averaged per sample; the engine's
batch weights must make every order below give exactly that update:

* ``interleaved``: forward, backward, forward, backward, ...
* ``fwd_fwd_bwd_bwd``: every forward of the step first, then the backwards in
  the same order (FairScale's ``test_fsdp_fwd_fwd_bwd_bwd``)
* ``reversed``: every forward first, then the backwards last to first
* ``auxiliary``: interleaved, with a ``torch.no_grad()`` forward of another
  batch size and a grad-enabled forward whose loss is dropped between each
  micro-batch's forward and its backward

``no_sync``: the first backwards of a step run under ``model.no_sync()`` (all
but the last one); without it, every backward reduces (accumulation by plain
repeated ``loss.backward()``).

``set_weight`` ("before" / "after" the forward): a third of the targets are
padding (ignored), the loss is the mean over the others, and the weight is
given with ``model.set_batch_weight(count)`` instead of being inferred.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, build_model, compare_to_reference, make_optimizer, rank_world
from uneven_cases import pool, rows_of  # every rank's samples of a micro-step, and this rank's rows

ORDERS = ("interleaved", "fwd_fwd_bwd_bwd", "reversed", "auxiliary")


def train_accumulating(spec: dict) -> dict:
    """Train the sharded model in ``spec["order"]`` and the one-process reference; compare."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                bucket_mb=spec.get("bucket_mb", 25.0), **spec.get("options", {}))
    norms = []
    for step in range(len(spec["sizes"])):
        _accumulate(spec, model, step, rank)
        if spec.get("max_norm") is not None:
            norms.append(float(model.clip_grad_norm_(spec["max_norm"])))
        optimizer.step()
        optimizer.zero_grad()
    ref_norms = _train_reference(spec, ref, make_optimizer(ref, spec["optimizer"]), world)
    return compare_to_reference(model, ref, norms, ref_norms)


def _accumulate(spec: dict, model, step: int, rank: int) -> None:
    micro_steps = len(spec["sizes"][step])
    order = spec["order"]

    def forward(micro: int) -> torch.Tensor:
        ids, targets = pool(spec, step, micro)
        mine = rows_of(spec, step, micro, rank)
        targets, count = _targets(spec, targets[mine])
        if spec.get("set_weight") == "before":
            model.set_batch_weight(count)
        loss = F.cross_entropy(model(ids[mine]).float(), targets, reduction="sum", ignore_index=-100)
        if spec.get("set_weight") == "after":
            model.set_batch_weight(count)
        return loss / max(count, 1) / micro_steps

    def backward(micro: int, loss: torch.Tensor) -> None:
        last = micro == backward_order[-1]
        with model.no_sync() if spec["no_sync"] and not last else contextlib.nullcontext():
            loss.backward()

    if order in ("interleaved", "auxiliary"):
        backward_order = list(range(micro_steps))
        for micro in backward_order:
            loss = forward(micro)
            if order == "auxiliary":
                _auxiliary_forwards(spec, model, rank)
            backward(micro, loss)
        return
    losses = [forward(micro) for micro in range(micro_steps)]
    backward_order = list(range(micro_steps))[::-1 if order == "reversed" else 1]
    for micro in backward_order:
        backward(micro, losses[micro])


def _targets(spec: dict, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """With ``set_weight``, targets divisible by 3 are padding; the count of the others."""
    if spec.get("set_weight") is None:
        return targets, targets.numel()
    masked = targets.masked_fill(targets % 3 == 0, -100)
    return masked, int((masked != -100).sum())


def _auxiliary_forwards(spec: dict, model, rank: int) -> None:
    """An evaluation forward and a forward whose loss is never backpropagated: neither may change
    the weight of the micro-step whose backward comes next."""
    ids = torch.arange(2 + rank) % spec["vocab"]
    with torch.no_grad():
        model(ids)
    model(ids[:1 + rank]).sum()  # grad enabled, dropped


def _train_reference(spec: dict, ref, optimizer, world: int) -> list[float]:
    norms = []
    for step in range(len(spec["sizes"])):
        losses, count = [], 0
        for micro in range(len(spec["sizes"][step])):
            ids, targets = pool(spec, step, micro)
            for r in range(world):
                mine, their = _targets(spec, targets[rows_of(spec, step, micro, r)])
                count += their
                losses.append(F.cross_entropy(ref(ids[rows_of(spec, step, micro, r)]), mine,
                                              reduction="sum", ignore_index=-100))
        (sum(losses) / count).backward()
        if spec.get("max_norm") is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["max_norm"])))
        optimizer.step()
        optimizer.zero_grad()
    return norms
