"""Rank workers for tests/engine/test_peer_exceptions.py: exceptions inside forward that leave the
ranks in step (FSDP2's test_reset_iter_state_after_exception, restated), so training goes on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardengine as se
from engine_cases import _single_thread, rel_err
from peer_structures_cases import shard_beside_reference
from rank_pool import rank_world


class RaisesMidway(nn.Module):
    """Three blocks; with ``raising`` set, the forward raises after the first (half its units gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        self.raising = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        if self.raising:
            raise ValueError("bad batch")
        for block in self.blocks[1:]:
            x = torch.tanh(block(x))
        return x


def train_through_exceptions(spec: dict) -> dict:
    """Three steps; before the second, a forward raises on ``spec["ranks"]`` (a training forward, or
    an evaluation one under no_grad with ``spec["eval"]``) and the loop catches it and goes on.
    The reference trains on the same three batches. The error against it, or the messages."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = RaisesMidway()
    model, optimizer, reference, reference_optimizer = shard_beside_reference(net, spec["stage"], timeout_s=30)
    gen = torch.Generator().manual_seed(5)
    caught = []
    try:
        for step in range(3):
            x, y = torch.randn(2 * world, 6, generator=gen), torch.randn(2 * world, 6, generator=gen)
            mine = slice(2 * rank, 2 * rank + 2)
            if step == 1:
                net.raising = rank in spec["ranks"]
                try:
                    with torch.no_grad() if spec["eval"] else torch.enable_grad():
                        model(x[mine])
                except ValueError as error:
                    caught.append(str(error))
                net.raising = False
            F.mse_loss(model(x[mine]), y[mine]).backward()
            optimizer.step()
            optimizer.zero_grad()
            F.mse_loss(reference(x), y).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
    except se.CollectiveError as error:
        return {"error": None, "caught": caught, "message": str(error)}
    full = model.full_state_dict()
    return {"error": max(rel_err(full[key], value) for key, value in reference.state_dict().items()),
            "caught": caught, "message": None}
