"""Rank workers: a backward pass that raises halfway (see test_backward_failure.py)."""

from __future__ import annotations

import torch
from torch import nn

import shardengine as se


class RaisesInBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: a user's op failing halfway through backward."""

    armed = True

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if RaisesInBackward.armed:
            raise RuntimeError("an op failed in backward")
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        x = RaisesInBackward.apply(x)  # the layers after it have had their gradients by then
        return self.layers[2](torch.tanh(self.layers[1](x)))


def next_call_after_failed_backward(stage: int, options: dict) -> str:
    """What the next training step says after a backward raised halfway."""
    net = Net()
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage,
                                bucket_mb=0.0001, **options)
    x = torch.randn(4, 6)
    RaisesInBackward.armed = True
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        assert "an op failed in backward" in str(error)
    finally:
        RaisesInBackward.armed = False
    try:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    except se.CollectiveError as error:
        return str(error)
    return "no error"
