"""Rank workers for tests/engine/test_peer_access.py: parameters used outside their unit's forward.

DeepSpeed's test_ext_param_getattr and test_ext_param_return, FSDP2's
test_partial_group_forward_then_standalone and its register_fsdp_forward_method, restated.
Each worker trains the sharded model beside a one-process reference on the global batch
(engine_cases' [Note: the reference]) and returns the largest relative error.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardengine as se
from engine_cases import _single_thread, rel_err
from rank_pool import rank_world

DIM = 8


class ExtParamGetattr(nn.Module):
    """DeepSpeed's test_ext_param_getattr: the parent reads ``self.linear1.weight`` after linear1 ran."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear2(self.linear1(x))
        return F.linear(hidden, self.linear1.weight)  # linear1's weight, outside linear1


class DanglingBias(nn.Linear):
    """DeepSpeed's test_ext_param_return: a module that returns its own bias."""

    def forward(self, x: torch.Tensor):
        return super().forward(x), self.bias


class ExtParamReturn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.dangler = nn.Linear(DIM, DIM), DanglingBias(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.dangler(self.linear1(x))
        return out + bias  # the bias, outside the module that owns it


class TiedHead(nn.Module):
    """FSDP2's test_partial_group_forward_then_standalone: the head shares the embedding's weight
    (so both live in the root unit); the forward applies it to the first chunk only, and the
    training loop calls it alone on each further chunk (a chunked loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, DIM)
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.head = nn.Linear(DIM, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor):
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = torch.tanh(block(hidden))
        return self.head(hidden[:1]), hidden[1:]


class Backbone(nn.Module):
    """A unit entered through another method (timm's ViT.forward_features)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.out(torch.tanh(self.proj(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x).sum(-1)


class CallsForwardFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit = nn.ModuleList([Backbone()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.vit[0].forward_features(x))


MODELS: dict[str, Callable[[], nn.Module]] = {"getattr": ExtParamGetattr, "return": ExtParamReturn,
                                                "tied_head": TiedHead, "forward_features": CallsForwardFeatures}


def _loss(name: str, model: nn.Module, head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name != "tied_head":
        return F.mse_loss(model(x), y)
    first, rest = model(x)
    losses = [F.cross_entropy(first, y[:1])]
    for chunk in range(len(rest)):  # the head alone, per chunk, outside the model's forward
        losses.append(F.cross_entropy(head(rest[chunk:chunk + 1]), y[1 + chunk:2 + chunk]))
    return torch.stack(losses).mean()


def _batch(name: str, world: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "tied_head":
        return torch.randint(0, 11, (world, 3), generator=gen), torch.randint(0, 11, (world, 3), generator=gen)
    out = 1 if name == "forward_features" else DIM
    return torch.randn(world, 2, DIM, generator=gen), torch.randn(world, 2, out, generator=gen)


def train_external(spec: dict) -> dict:
    """Train ``MODELS[spec["model"]]`` with ``spec["options"]``; with ``spec["register"]`` the
    backbone's ``forward_features`` is registered first. The error against one process, or the
    error message."""
    _single_thread()
    rank, world = rank_world()
    name = spec["model"]
    torch.manual_seed(0)
    net = MODELS[name]()
    reference = copy.deepcopy(net)
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=1e-2), stage=spec["stage"],
                                **spec.get("options", {}))
    if spec.get("register"):
        se.model.register_forward_method(net.vit[0], "forward_features")
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    try:
        for _ in range(2):
            x, y = _batch(name, world, gen)
            _loss(name, model, getattr(net, "head", None), x[rank], y[rank]).backward()
            optimizer.step()
            optimizer.zero_grad()
            reference_loss = sum(_loss(name, reference, getattr(reference, "head", None), x[r], y[r])
                                 for r in range(world)) / world
            reference_loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        with torch.no_grad():  # an evaluation forward reads them outside their units too
            evaluated = _loss(name, model, getattr(net, "head", None), x[rank], y[rank])
    except Exception as error:  # noqa: BLE001 - the test reads which error it was
        return {"error": None, "message": f"{type(error).__name__}: {error}"}
    full = model.full_state_dict()
    return {"error": max(rel_err(full[key], value) for key, value in reference.state_dict().items()),
            "evaluated": float(evaluated), "message": None}
