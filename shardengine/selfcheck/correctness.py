"""Stages 0-3, fp32 and mixed precision, against one process training the whole batch.

Every rank trains the sharded model on its own slice of a global batch; every
rank also trains an unsharded copy (same initial weights) on the whole global
batch, in plain torch. With the mean loss, equal slices and SGD with momentum
(whose update is proportional to the gradient, so a wrong average shows, unlike
Adam's scale-free one) the two must end at the same weights up to the
reduction order: ``fp32`` within ``FP32_TOLERANCE``. Mixed precision (bf16
compute, fp32 masters and reductions) is held to the fp32 reference within
``BF16_TOLERANCE``: bf16 keeps 8 bits of mantissa, so each gradient is off by
up to ~0.4% of its size, and each step moves a weight by lr x gradient.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

import shardengine as se
from shardengine.testing.models import build_gpt, example_inputs, lm_loss

from .verdict import Check

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-3
LEARNING_RATE = 0.05


@dataclasses.dataclass(frozen=True)
class TrainingCase:
    """The small model and batches every correctness run uses."""

    preset: str = "tiny"
    vocab: int = 64
    seq_len: int = 32
    micro_batch: int = 2      # per rank
    steps: int = 3

    def model(self, device: torch.device) -> torch.nn.Module:
        return build_gpt(self.preset, vocab_size=self.vocab, seq_len=self.seq_len, seed=0).to(device)

    def batch(self, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return example_inputs(self.micro_batch, self.seq_len, self.vocab, seed=1000 * step + rank, device=device)

    def global_batch(self, step: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.batch(step, rank, device) for rank in range(world)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9)


def reference_weights(case: TrainingCase, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, plain torch."""
    model = case.model(device)
    optimizer = _optimizer(model.parameters())
    for step in range(case.steps):
        idx, targets = case.global_batch(step, world, device)
        lm_loss(model(idx), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach().float() for name, value in model.state_dict().items()}


def sharded_weights(case: TrainingCase, stage: int, precision: str, rank: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's share of the training, then the full fp32 weights (every rank calls it)."""
    module = case.model(device)
    options = {} if precision == "fp32" else {"param_dtype": precision}
    model, optimizer = se.shard(module, _optimizer(module.parameters()), stage=stage, **options)
    for step in range(case.steps):
        idx, targets = case.batch(step, rank, device)
        lm_loss(model(idx).float(), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach().float().to(device) for name, value in model.full_state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        missing = sorted(set(a) ^ set(b))
        raise AssertionError(f"the sharded model's keys differ from the reference's: {missing[:5]}")
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].numel())


def correctness_checks(stages: Sequence[int], precisions: Sequence[str], rank: int, world: int,
                       device: torch.device, case: TrainingCase = TrainingCase()) -> list[Check]:
    """One row per (stage, precision): max |weight difference| after ``case.steps`` steps."""
    reference = reference_weights(case, world, device)
    checks = []
    for precision in precisions:
        tolerance = FP32_TOLERANCE if precision == "fp32" else BF16_TOLERANCE
        for stage in stages:
            name = f"stage {stage} {precision}, N={world}"
            started = time.perf_counter()
            try:
                difference = max_difference(sharded_weights(case, stage, precision, rank, device), reference)
            except Exception as error:  # a crash is the verdict of this row, not of the whole run
                checks.append(Check("correctness", name, "fail", f"{type(error).__name__}: {error}"))
                continue
            status = "pass" if difference <= tolerance else "fail"
            checks.append(Check("correctness", name, status,
                                f"max |Δweight| vs one process {difference:.1e} (≤ {tolerance:.0e}), "
                                f"{case.steps} steps, {time.perf_counter() - started:.1f} s"))
    return checks
