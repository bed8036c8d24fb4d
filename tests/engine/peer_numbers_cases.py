"""Rank workers for tests/engine/test_peer_numbers.py: peers' own tests restated on this API.

Each worker restates one test of FSDP2's, DeepSpeed's or torch DDP's suite (named in its
docstring) where this engine once gave a silent wrong number: an integer parameter at
stage 3 under bf16, a zero gradient treated as none, a re-assigned buffer. Where torch's
own object runs here (DDP on Gloo), the worker trains it on the same data in the same
process group and returns both.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardengine as se
from engine_cases import _single_thread
from rank_pool import rank_world


# --------------------------------------------------------------------------- integer parameters


class WithCounts(nn.Module):
    """Two blocks and an int64 parameter the forward reads (257 and 263 round in bf16)."""

    COUNTS = (257, 263, 1025, 7)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.counts = nn.Parameter(torch.tensor(self.COUNTS, dtype=torch.int64), requires_grad=False)
        self.seen: list[tuple[torch.dtype, list[int]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.counts.dtype, self.counts.tolist()))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x * (self.counts % 2).to(x.dtype)


def integer_parameter(spec: dict) -> dict:
    """An int64 ``nn.Parameter(requires_grad=False)`` under ``param_dtype="bf16"``: what the forward
    reads, what ``full_state_dict()`` and ``state_dict()`` return, and a checkpoint round trip.
    FSDP2's ``MixedPrecisionPolicy(bf16, fp32)`` casts floating-point tensors only."""
    _single_thread()
    rank, _ = rank_world()
    torch.manual_seed(0)
    net = WithCounts()
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=spec["stage"],
                                param_dtype="bf16")
    for step in range(2):
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    full, plain = model.full_state_dict(), model.state_dict()
    se.save_checkpoint(spec["path"], model, optimizer, extra={"step": 2})
    torch.manual_seed(1)
    other = WithCounts()
    with torch.no_grad():
        other.counts.fill_(3)
    loaded, loaded_optimizer = se.shard(other, torch.optim.AdamW(other.parameters(), lr=1e-2),
                                        stage=spec["stage"], param_dtype="bf16")
    se.load_checkpoint(spec["path"], loaded, loaded_optimizer)
    loaded(torch.ones(1, 4))
    return {"seen": net.seen, "full": (full["counts"].dtype, full["counts"].tolist()),
            "state_dict": (plain["counts"].dtype, plain["counts"].tolist()),
            "loaded_seen": other.seen[-1], "loaded_full": loaded.full_state_dict()["counts"].tolist()}


# --------------------------------------------------------------------------- zero versus absent gradients


class TwoOutputs(nn.Module):
    """FSDP2's test_unused_forward_output: the forward returns two outputs; later steps use one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
        self.used, self.unused = nn.Linear(5, 3), nn.Linear(5, 3)
        self.never = nn.Linear(5, 3)  # no gradient ever: grad stays None, never stepped

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.used(x), self.unused(x)


def _two_output_batches(world: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(2 * world, 5, generator=gen) for _ in range(steps)]


def _two_output_loss(outputs: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    used, unused = outputs
    return used.pow(2).mean() + (unused.pow(2).mean() if step == 0 else 0)


def zero_gradients_are_stepped(spec: dict) -> dict:
    """With ``zero_grad(set_to_none=spec["set_to_none"])`` a parameter that got a gradient in the
    first step and none after is stepped with a zero gradient (set_to_none=False: Adam's momentum
    moves it) or left alone (True), as torch on one process and DDP(find_unused_parameters=True).
    Returns this engine's parameters, torch DDP's and a one-process reference's."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = TwoOutputs()
    reference, ddp_net = copy.deepcopy(net), copy.deepcopy(net)
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=spec["stage"],
                                **spec.get("options", {}))
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_net, find_unused_parameters=True)
    ddp_optimizer = torch.optim.AdamW(ddp_net.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    set_to_none = spec["set_to_none"]
    for step, x in enumerate(_two_output_batches(world, spec["steps"])):
        mine = x[2 * rank:2 * rank + 2]
        _two_output_loss(model(mine), step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        _two_output_loss(ddp(mine), step).backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad(set_to_none=set_to_none)
        _two_output_loss(reference(x), step).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=set_to_none)
    return {"ours": model.full_state_dict(), "ddp": ddp_net.state_dict(), "reference": reference.state_dict()}


# --------------------------------------------------------------------------- a re-assigned buffer


class WithBuffer(nn.Module):
    """torch DDP's test_ddp_broadcast_buffer: NetWithBuffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)
        self.register_buffer("buffer", torch.randn(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def reassigned_buffer(spec: dict) -> dict:
    """Rank 0 re-assigns the buffer (a new tensor) before each forward; after each backward every
    rank holds rank 0's buffer, under this engine and under DDP, which run side by side."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(rank)  # as the DDP test: each rank starts from its own buffer
    net = WithBuffer()
    ddp_net = copy.deepcopy(net)
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"])
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_net)
    ddp_optimizer = torch.optim.SGD(ddp_net.parameters(), lr=0.1)
    x = torch.randn(2, 10, generator=torch.Generator().manual_seed(rank))
    ours, theirs = [], []
    for _ in range(3):
        if rank == 0:
            model.module.buffer = model.module.buffer + 1
            ddp.module.buffer = ddp.module.buffer + 1
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ddp(x).sum().backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
        ours.append(model.module.buffer.clone())
        theirs.append(ddp.module.buffer.clone())
    return {"ours": ours, "ddp": theirs, "state": model.full_state_dict()["buffer"]}
