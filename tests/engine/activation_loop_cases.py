"""Workers for test_activation_loops.py: training loops other than one forward, one backward.

Each loop runs twice in the same ranks, without an activation policy and with one; the two
must agree exactly (checkpointing recomputes the same kernels, offload copies bytes), and the
run without a policy is the engine's own, which the equivalence tests hold to one process.
"""

from __future__ import annotations

import torch

import shardengine as se
from activation_cases import _batch
from engine_cases import _single_thread, rank_world, rel_err
from shardengine.testing.models import build_gpt, lm_loss

VOCAB, SEQ, PER_RANK = 64, 32, 2


def _micro_batches(step: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rank, world = rank_world()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return [(ids[mine], targets[mine]) for ids, targets in
            (_batch(step, micro, world, PER_RANK) for micro in range(count))]


def _loop(model, batches, loop: str) -> list[float]:
    """One optimizer step's forwards and backwards, as ``loop`` names them."""
    if loop == "forwards_then_backwards":  # every forward first, then every backward (accumulation)
        losses = [lm_loss(model(ids), targets) / len(batches) for ids, targets in batches]
        for loss in losses:
            loss.backward()
        return [float(loss.detach()) for loss in losses]
    if loop == "retain_graph":  # the same graph backpropagated twice: the gradient doubles
        ids, targets = batches[0]
        loss = lm_loss(model(ids), targets)
        loss.backward(retain_graph=True)
        loss.backward()
        return [float(loss.detach())]
    if loop == "accumulate_without_no_sync":  # every micro-step reduces (correct, just slower)
        losses = []
        for ids, targets in batches:
            loss = lm_loss(model(ids), targets) / len(batches)
            loss.backward()
            losses.append(float(loss.detach()))
        return losses
    raise ValueError(loop)


def _train(spec: dict, policy: dict) -> dict:
    net = build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ, seed=0, n_layer=3)
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=spec["stage"], **policy)
    losses, hosts = [], []
    for step in range(2):
        losses += _loop(model, _micro_batches(step, 3), spec["loop"])
        hosts.append(model.memory_report().peak_host_activations)
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.float() for k, v in model.full_state_dict().items()}
    return {"state": state, "losses": losses, "hosts": hosts}


def loop_with_and_without(spec: dict) -> dict:
    _single_thread()
    plain, policed = _train(spec, {}), _train(spec, spec["policy"])
    return {"errors": {key: rel_err(policed["state"][key], value) for key, value in plain["state"].items()},
            "losses": (plain["losses"], policed["losses"]), "hosts": policed["hosts"]}
