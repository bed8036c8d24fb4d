"""Fine-tuning workers: frozen bases with trainable adapters, at every stage.

Module-level functions that run on a pool rank or in-process (see
``engine_cases``). Each trains the sharded model and, in the same process, an
unwrapped deep copy on the global batch, and reports the relative error of
every parameter (see [Note: the reference] in engine_cases.py).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardengine as se
from engine_cases import _single_thread, compare_to_reference, rank_world, rel_err

# --------------------------------------------------------------------------- a LoRA-style model


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` (as LoRA adds it)."""

    def __init__(self, dim: int, rank: int, frozen_base: bool = True):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(not frozen_base)
        self.A = nn.Parameter(torch.randn(rank, dim) / math.sqrt(dim))
        self.B = nn.Parameter(torch.randn(dim, rank) * 0.1)  # non-zero: B and A both get gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.A), self.B)


class LoraBlock(nn.Module):
    """Adapted attention-like projection, then a frozen MLP; residual connections."""

    def __init__(self, dim: int, rank: int, frozen: str):
        super().__init__()
        self.proj = LoraLinear(dim, rank)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        for module in (self.up, self.down):
            module.requires_grad_(False)
        if frozen == "all":  # a whole unit frozen: only its input gradient is needed
            self.requires_grad_(False)
        elif frozen == "none":
            self.requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.proj(x))
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class LoraNet(nn.Module):
    """Frozen embedding -> blocks -> head.

    ``blocks``: one frozen-pattern per block, "lora" (frozen base, trainable A and
    B, frozen MLP), "all" (everything frozen) or "none" (everything trainable).
    ``tied``: the output projection is the (frozen) embedding, with a trainable
    bias and norm after the blocks, so the root unit mixes frozen and trainable.
    ``ckpt``: None, "reentrant" or "non_reentrant" (torch.utils.checkpoint per block).
    """

    def __init__(self, vocab: int = 13, dim: int = 16, rank: int = 4,
                 blocks: tuple[str, ...] = ("lora", "lora"), tied: bool = False, ckpt: Optional[str] = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(LoraBlock(dim, rank, frozen) for frozen in blocks)
        self.final_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        if tied:
            self.head.weight = self.embed.weight  # frozen, shared; head.bias and the norm train
        else:
            self.head.requires_grad_(False)
            self.final_norm.requires_grad_(False)
        self.ckpt = ckpt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            if self.ckpt is None:
                x = block(x)
            else:
                if self.ckpt == "reentrant" and not x.requires_grad:
                    x = x.detach().requires_grad_()  # reentrant checkpoint needs an input that requires grad
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(self.final_norm(x))


def lora_batch(vocab: int, step: int, size: int, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return (torch.randint(0, vocab, (size, seq), generator=gen),
            torch.randint(0, vocab, (size, seq), generator=gen))


def train_lora_and_compare(spec: dict) -> dict:
    """spec: stage, blocks, tied, ckpt, steps, per_rank_batch, options (shard kwargs)."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec.get("seed", 0))
    net = LoraNet(blocks=tuple(spec["blocks"]), tied=spec.get("tied", False), ckpt=spec.get("ckpt"))
    ref = copy.deepcopy(net)
    trainable = [p for p in net.parameters() if p.requires_grad]
    model, optimizer = se.shard(net, torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01),
                                stage=spec["stage"], **spec.get("options", {}))
    ref_optimizer = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                      weight_decay=0.01)
    b = spec.get("per_rank_batch", 2)
    norms, ref_norms = [], []
    for step in range(spec.get("steps", 2)):
        ids, targets = lora_batch(13, step, b * world)
        mine = slice(rank * b, (rank + 1) * b)
        out = model(ids[mine])
        F.cross_entropy(out.flatten(0, 1), targets[mine].flatten()).backward()
        F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten()).backward()
        norms.append(float(model.clip_grad_norm_(1.0)))
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(
            [p for p in ref.parameters() if p.requires_grad], 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    result = compare_to_reference(model, ref, norms, ref_norms)
    result["live_after"] = model.memory_report().comm_buffers if spec["stage"] == 3 else 0
    return result


def train_lora_cases(specs: list[dict]) -> list[dict]:
    """Several ``train_lora_and_compare`` runs in one call (the rank pool's round trip is the cost)."""
    results = []
    for spec in specs:
        result = train_lora_and_compare(spec)
        result.pop("state")
        results.append(result)
    return results


def units_live_during_backward(spec: dict) -> dict:
    """Stage 3, prefetch 0: how many block units are gathered each time a block's input
    gradient is complete (the block's backward is over there), and after the step."""
    _single_thread()
    torch.manual_seed(0)
    net = LoraNet(blocks=tuple(spec["blocks"]), ckpt=spec.get("ckpt"))
    model, optimizer = se.shard(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad]),
                                stage=3, prefetch=0)
    engine = model.engine
    blocks = [u for u in engine.layout.units if u.module is not net]
    seen: list[int] = []

    def count(grad: torch.Tensor) -> None:
        seen.append(sum(all(b.full_params_live for b in unit.buckets) for unit in blocks))

    def watch_input(module, args) -> None:
        recomputing = torch._C._current_graph_task_id() != -1
        # Reentrant checkpointing differentiates the recomputed forward (its first forward ran
        # without grad); non-reentrant differentiates the original one.
        differentiated = recomputing == (spec.get("ckpt") == "reentrant")
        if torch.is_grad_enabled() and args[0].requires_grad and differentiated:
            args[0].register_hook(count)

    handles = [block.register_forward_pre_hook(watch_input) for block in net.blocks]
    rank, world = rank_world()
    ids, targets = lora_batch(13, 0, 2 * world)
    out = model(ids[rank * 2:(rank + 1) * 2])
    F.cross_entropy(out.flatten(0, 1), targets[rank * 2:(rank + 1) * 2].flatten()).backward()
    optimizer.step()
    for handle in handles:
        handle.remove()
    return {"live_at_block_inputs": seen,
            "live_after": sum(all(b.full_params_live for b in unit.buckets) for unit in engine.layout.units)}


def units_held_through_a_lora_step(blocks: int) -> dict:
    """Stage 3, default prefetch, LoRA blocks (frozen base, trainable A and B): at the second
    step, what the allocator holds once the forward is over (counted from the step's start:
    activations, and any gathered weights autograd saved), and the most gathered parameter bytes
    (the engine's own count, ``peak_comm_buffers``) during the backward; with the sizes of a
    block's and the root's gathered buffers and of the gradients a block reduces."""
    from shardengine.testing.allocator_tracker import AllocatorTracker

    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = LoraNet(dim=64, blocks=("lora",) * blocks)
    model, optimizer = se.shard(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad]), stage=3)
    units = {unit.module: unit for unit in model.engine.layout.units}
    sizes = {"block": max(sum(b.param_nbytes for b in units[m].buckets) for m in net.blocks),
             "root": sum(b.param_nbytes for b in units[net].buckets),
             "block_grads": max(sum(b.grad_nbytes for b in units[m].grad_buckets) for m in net.blocks)}
    for step in range(2):  # the second step prefetches in forward too (it follows the first's order)
        ids, targets = lora_batch(13, step, 2 * world)
        with AllocatorTracker() as tracker:
            with tracker.phase("step"):
                out = model(ids[rank * 2:(rank + 1) * 2])
                loss = F.cross_entropy(out.flatten(0, 1), targets[rank * 2:(rank + 1) * 2].flatten())
                model.step_stats()  # the engine's peak restarts: the backward's own from here
                with tracker.phase("backward"):
                    loss.backward()
        backward_peak = model.memory_report().peak_comm_buffers
        optimizer.step()
        optimizer.zero_grad()
    return {**sizes, "after_forward": tracker.live_at_start_of("backward", since="step"),
            "backward_gathered_peak": backward_peak}


def memory_of_frozen_base(spec: dict) -> dict:
    """memory_report() after a step of a mostly frozen model, with the plan's element counts."""
    from shardengine.flat.plan import count_elements
    from shardengine.stages.recipes import STAGES

    _single_thread()
    _, world = rank_world()
    torch.manual_seed(0)
    net = LoraNet(blocks=("lora", "all", "lora"), tied=True)
    counts = count_elements(net, world, STAGES[spec["stage"]].spec.bucket_shape)
    trainable = [p for p in net.parameters() if p.requires_grad]
    model, optimizer = se.shard(net, torch.optim.AdamW(trainable, lr=1e-3), stage=spec["stage"],
                                param_dtype=spec.get("param_dtype"))
    rank, _ = rank_world()
    ids, targets = lora_batch(13, 0, 2 * world)
    out = model(ids[rank * 2:(rank + 1) * 2])
    F.cross_entropy(out.flatten(0, 1), targets[rank * 2:(rank + 1) * 2].flatten()).backward()
    optimizer.step()
    report = model.memory_report()
    owned = sum(f.numel for b in model.engine.buckets if b.requires_grad for f in b.layout.fragments(b.rank))
    return {"report": report.as_dict(), "trainable": counts.trainable, "padded": counts.padded,
            "shard": counts.shard, "owned": owned, "frozen": counts.frozen}
