"""Rank workers for tests/engine/test_peer_structures.py: units whose inputs and outputs are
structures (FSDP2's test_structured_input_output), and units picked inside containers.

Each worker trains the sharded model and, in the same process, a one-process reference on
the global batch (engine_cases' [Note: the reference]) and returns the largest relative error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import shardengine as se
from engine_cases import _single_thread, rel_err
from rank_pool import rank_world


@dataclass
class Activation:
    """A dataclass torch's pytree does not know."""

    x: torch.Tensor
    note: str = "plain"


@dataclass
class RegisteredActivation:
    """The same, registered with pytree (FSDP2's test runs both)."""

    x: torch.Tensor
    note: str = "registered"


pytree.register_dataclass(RegisteredActivation, field_names=["x"], drop_field_names=["note"])


class Holder:
    """Neither a dataclass nor known to pytree: an object holding its tensor in an attribute."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


KINDS: dict[str, Any] = {"dataclass": Activation, "registered": RegisteredActivation, "object": Holder}


class StructuredBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(6, 6)

    def forward(self, activation) -> Any:
        return KINDS[self.kind](torch.tanh(self.linear(activation.x)))


class StructuredNet(nn.Module):
    """Three units (ModuleList elements) passing structures to each other: with ``prefetch=1`` the
    middle one is gathered for backward only through the hooks on its outputs."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList([StructuredBlock(kind) for _ in range(3)])
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = KINDS[self.kind](x)
        for block in self.blocks:
            activation = block(activation)
        return self.head(activation.x)


def shard_beside_reference(net: nn.Module, stage: int, **options):
    """``(model, optimizer, reference, reference_optimizer)``: Adam on the sharded ``net`` and on a
    one-process copy made before ``shard()``."""
    reference = copy.deepcopy(net)
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=1e-2), stage=stage, **options)
    return model, optimizer, reference, torch.optim.Adam(reference.parameters(), lr=1e-2)


def train_beside_reference(net: nn.Module, stage: int, steps: int = 2, **options) -> tuple[nn.Module, float]:
    """Train ``net`` sharded and a one-process reference on the global batch (6 features in, 2 out);
    the sharded model and the largest relative error of its parameters."""
    rank, world = rank_world()
    model, optimizer, reference, reference_optimizer = shard_beside_reference(net, stage, **options)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x, y = torch.randn(2 * world, 6, generator=gen), torch.randn(2 * world, 2, generator=gen)
        F.mse_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
        optimizer.step()
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    full = model.full_state_dict()
    return model, max(rel_err(full[key], value) for key, value in reference.state_dict().items())


def train_structured(spec: dict) -> dict:
    _single_thread()
    torch.manual_seed(0)
    _, error = train_beside_reference(StructuredNet(spec["kind"]), spec["stage"], prefetch=1)
    return {"error": error}


class WithContainers(nn.Module):
    """A root holding a ModuleList and a ModuleDict of layers: containers whose forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(6, 2), "b": nn.Linear(6, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.heads["a"](x) + self.heads["b"](x)


def train_with_containers(spec: dict) -> dict:
    """``wrap_min_params=1`` on a root that holds containers: the units picked, and the error
    against one process after two steps."""
    _single_thread()
    torch.manual_seed(0)
    model, error = train_beside_reference(WithContainers(), spec["stage"], wrap_min_params=1)
    return {"error": error, "units": [unit.name for unit in getattr(model.engine.layout, "units", [])]}
