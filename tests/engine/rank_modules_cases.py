"""Rank workers for tests/engine/test_rank_dependent_modules.py: ranks that run different modules.

At stage 3 a rank gathers a unit when its forward calls it; ranks whose forwards call
different units must still issue the same collectives (distributed/sequence.py). Each
worker trains the sharded model and, in the same process, a one-process reference on every
rank's data (each rank's loss through the modules that rank chose; the mean over ranks).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import shardengine as se
from engine_cases import _single_thread, rel_err
from rank_pool import rank_world


class ChooseByRank(nn.Module):
    """DeepSpeed's test_choose_module_by_rank: rank r runs only ``linears[r % 2]``."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.head(torch.tanh(self.linears[rank % 2](x)))


class RoutedExperts(nn.Module):
    """A mixture of experts whose experts are separate modules, each run only on the tokens routed
    to it (top-1): which experts a rank runs, and in which order, depends on its data."""

    def __init__(self, dim: int = 6, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, dim))
                                      for _ in range(experts)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        choice = gates.argmax(dim=-1)
        out = torch.zeros_like(x)
        for expert in torch.unique(choice).tolist():
            rows = choice == expert
            out = out.index_put((rows,), self.experts[expert](x[rows]) * gates[rows, expert:expert + 1])
        return self.head(out + x)


def _data(world: int, steps: int, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, every rank's inputs and targets (4 rows each), drawn alike on every rank; each
    rank's rows are shifted apart so that routing sends them to different experts."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randn(world, 4, dim, generator=gen) + 3 * torch.randn(world, 1, dim, generator=gen)
        out.append((x, torch.randn(world, 4, 1, generator=gen)))
    return out


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
    return F.mse_loss(model(x, rank), y)


def train_rank_dependent(spec: dict) -> dict:
    """Train ``spec["model"]`` at ``spec["stage"]`` with ``spec["options"]``; the relative error of
    every parameter against the one-process reference, and how many gathers this rank served."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = {"choose": ChooseByRank, "experts": RoutedExperts}[spec["model"]]()
    reference = copy.deepcopy(net)
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=1e-2), stage=spec["stage"],
                                **spec.get("options", {}))
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    losses = []
    for x, y in _data(world, spec["steps"], 6):
        loss = _loss(model, x[rank], y[rank], rank)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        total = sum(_loss(reference, x[r], y[r], r) for r in range(world)) / world
        total.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    with torch.no_grad():  # an evaluation forward: its gathers follow the routing too
        model(_data(world, 1, 6)[0][0][rank], rank)
    full = model.full_state_dict()
    sequence = getattr(model.engine.comm, "sequence", None)
    return {"errors": {key: rel_err(full[key], value) for key, value in reference.state_dict().items()},
            "served": sequence.served if sequence is not None else 0, "losses": losses,
            "units": [unit.name for unit in getattr(model.engine.layout, "units", [])]}
