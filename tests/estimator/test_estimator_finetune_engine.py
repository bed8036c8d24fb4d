"""The estimator's fine-tuning terms against shardengine's own ``memory_report()``.

A LoRA-style model (a frozen base: embedding, blocks of frozen linears each with a
trainable low-rank ``A``/``B`` pair, a frozen head), sharded at stages 0-2 on 2 ranks,
after gradient accumulation and a step: params, grads and optimizer states per rank
equal the estimate (the module planned exactly), and the analytic path (a count plus
``trainable_params``) agrees with it to the padding. Muon at stage 0 keeps one fp32
momentum buffer per parameter, as the estimator says.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memory_estimator import EngineOptions, estimate
from rank_pool import RankPoolRegistry

DIM, RANK, VOCAB, BLOCKS = 24, 4, 13, 3


class LoraLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoraNet(nn.Module):
    """Frozen embedding and head; blocks whose linears are frozen and carry adapters."""

    def __init__(self, embed: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if embed else None
        if self.embed is not None:
            self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(LoraLinear(DIM, DIM, RANK) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) if self.embed is not None else F.one_hot(ids, DIM).float()
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def trainable(net: nn.Module) -> list[nn.Parameter]:
    return [p for p in net.parameters() if p.requires_grad]


def make_optimizer(net: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "muon":
        return torch.optim.Muon(trainable(net), lr=1e-2)
    if name == "adafactor":
        return torch.optim.Adafactor(trainable(net), lr=1e-2)
    return torch.optim.AdamW(trainable(net), lr=1e-3)


def report_after_accumulation(spec: dict) -> dict:
    """Rank worker: shard, accumulate ``accum`` micro-steps (no_sync on all but the last), step."""
    import torch.distributed as dist

    import shardengine as se

    if dist.is_initialized():
        torch.set_num_threads(1)
    torch.manual_seed(0)
    net = LoraNet(embed=spec["optimizer"] not in ("muon", "adafactor"))
    options = {"stage": spec["stage"], "bucket_mb": spec["bucket_mb"]}
    if spec["precision"] != "fp32":
        options["param_dtype"] = spec["precision"]
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), **options)
    for micro in range(spec["accum"]):
        ids = torch.randint(VOCAB if spec["optimizer"] not in ("muon", "adafactor") else DIM, (2, 5))
        last = micro == spec["accum"] - 1
        context = model.no_sync() if not last and hasattr(model, "no_sync") else _nothing()
        with context:
            F.cross_entropy(model(ids).float().reshape(-1, VOCAB), ids.reshape(-1) % VOCAB).backward()
    optimizer.step()
    report = model.memory_report().as_dict()  # gradients held from backward to the step: the peak's
    optimizer.zero_grad()                      # frees them (set_to_none=True)
    return report


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def predicted(spec: dict, world_size: int) -> dict:
    net = LoraNet(embed=spec["optimizer"] not in ("muon", "adafactor"))
    result = estimate(module=net, world_size=world_size, precision=spec["precision"],
                      optimizer=make_optimizer(net, spec["optimizer"]), grad_accum=spec["accum"],
                      engine_options=EngineOptions(bucket_mb=spec["bucket_mb"]), device_memory_bytes=10**15)
    plan = result.plan(["ddp", "zero1", "zero2", "zero3"][spec["stage"]])
    return {"params": plan.params, "grads": plan.grads, "optimizer_states": plan.optimizer_states}


def check(rank_pools: RankPoolRegistry, spec: dict, world_size: int = 2) -> None:
    reports = rank_pools.get(world_size).run(report_after_accumulation, spec)
    expected = predicted(spec, world_size)
    largest = {key: max(report[key] for report in reports) for key in expected}
    assert largest == expected, f"engine's largest rank {largest} != estimator {expected} ({spec})"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_lora_model_states_equal_memory_report(rank_pools: RankPoolRegistry, stage: int) -> None:
    # bf16 with fp32 masters: the frozen base in bf16 beside the adapters' masters and state;
    # buckets of 0.0002 MiB split the adapters over several buckets (padding per bucket).
    check(rank_pools, dict(stage=stage, precision="bf16", optimizer="adamw", bucket_mb=0.0002, accum=2))


def test_lora_model_states_equal_memory_report_at_stage_3(rank_pools: RankPoolRegistry) -> None:
    check(rank_pools, dict(stage=3, precision="bf16", optimizer="adamw", bucket_mb=25.0, accum=2))


def test_muon_at_stage_0_keeps_one_fp32_momentum_per_parameter(rank_pools: RankPoolRegistry) -> None:
    spec = dict(stage=0, precision="fp32", optimizer="muon", bucket_mb=25.0, accum=1)
    check(rank_pools, spec)
    adapters = sum(p.numel() for p in trainable(LoraNet(embed=False)))
    assert predicted(spec, 2)["optimizer_states"] == 4 * adapters


def test_adafactor_at_stage_0_keeps_row_and_column_statistics(rank_pools: RankPoolRegistry) -> None:
    spec = dict(stage=0, precision="fp32", optimizer="adafactor", bucket_mb=25.0, accum=1)
    check(rank_pools, spec)
    factored = sum(p.shape[0] + p.shape[1] for p in trainable(LoraNet(embed=False)))
    assert predicted(spec, 2)["optimizer_states"] == 4 * factored


def test_analytic_frozen_base_matches_the_planned_module() -> None:
    """A count with ``trainable_params`` gives the planned module's states up to padding."""
    net = LoraNet()
    psi = sum(p.numel() for p in net.parameters())
    lora = sum(p.numel() for p in trainable(net))
    for stage, name in enumerate(["ddp", "zero1", "zero2"]):
        exact = estimate(module=net, world_size=2, precision="bf16", device_memory_bytes=10**15).plan(name)
        counted = estimate(params=psi, trainable_params=lora, world_size=2, precision="bf16",
                           device_memory_bytes=10**15).plan(name)
        for term in ("params", "grads", "optimizer_states"):
            assert abs(getattr(exact, term) - getattr(counted, term)) <= 16 * 2, (stage, term)
