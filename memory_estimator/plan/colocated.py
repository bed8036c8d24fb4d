"""The colocated RL plan: the trainer's plan and a rollout engine on the same device, phase by phase.

[Note: three moments of an RL step]
A colocated RL step (GRPO, PPO) passes through three moments on each device, and its peak is
the largest of them:

* **train**: the trainer's own peak (the plan's total: activations, gradients, the step) plus
  what the rollout engine keeps resident meanwhile (its weights and KV cache, or nothing
  under vLLM's sleep mode);
* **generate**: the trainer between steps (its parameters and optimizer states; gradients
  only when ``zero_grad`` keeps them) beside the rollout's weights, KV cache and
  activations;
* **sync**: the trainer between steps, the rollout's weights (loaded in place) and the
  stream's bucket (``model.stream_weights``' cap), plus the KV cache unless it slept.

Each moment carries the trainer's fixed overheads (CUDA context, NCCL buffers) once and the
allocator's fragmentation at the plan's own rate. So "does my GRPO run fit on 8 x H100?" is
the verdict of the worst moment against the usable memory, per plan.

>>> from memory_estimator.api import estimate
>>> answer = colocated_rl(estimate(config="tests/configs/llama-3.1-8b.json", world_size=8,
...                                device="H100-80GB"), RolloutRequest(kv_tokens=65536))
>>> {p.name: p.fits for p in answer.plans if p.name in ("ddp", "zero3")}
{'ddp': False, 'zero3': True}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..terms.rollout import RolloutRequest, RolloutTerms, rollout_terms
from .memory import PlanEstimate, usable_bytes

if TYPE_CHECKING:
    from ..api import Estimate

FIXED_BUFFERS = ("cuda_context", "nccl_buffers")
FRAGMENTATION = "allocator_fragmentation"


@dataclass(frozen=True)
class ColocatedPlan:
    """One trainer plan with the rollout beside it: each moment's bytes per device, and the verdict."""

    name: str
    train: int
    generate: int
    sync: int
    usable: int

    @property
    def peak(self) -> int:
        return max(self.train, self.generate, self.sync)

    @property
    def moment(self) -> str:
        return max(("train", "generate", "sync"), key=lambda m: getattr(self, m))

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    @property
    def headroom(self) -> int:
        return self.usable - self.peak

    def to_json_dict(self) -> dict:
        return {"name": self.name, "train": self.train, "generate": self.generate, "sync": self.sync,
                "peak": self.peak, "peak_moment": self.moment, "fits": self.fits, "headroom": self.headroom}


@dataclass(frozen=True)
class ColocatedRL:
    """Every plan of an estimate with the rollout beside it; ``recommended``: the least sharded that fits."""

    request: RolloutRequest
    rollout: RolloutTerms
    plans: tuple[ColocatedPlan, ...]

    @property
    def recommended(self) -> str | None:
        return next((plan.name for plan in self.plans if plan.fits), None)

    def to_json_dict(self) -> dict:
        terms = self.rollout
        return {"rollout": {"weights": terms.weights, "kv_cache": terms.kv_cache, "activations": terms.activations,
                            "sync_bucket": terms.sync_bucket, "dtype": self.request.dtype,
                            "kv_tokens": self.request.kv_tokens, "tensor_parallel": self.request.tensor_parallel,
                            "sleep": self.request.sleep},
                "plans": [plan.to_json_dict() for plan in self.plans], "recommended": self.recommended}


def colocated_plan(plan: PlanEstimate, rollout: RolloutTerms, request: RolloutRequest, usable: int,
                   keeps_grads: bool) -> ColocatedPlan:
    """The three moments of ``plan`` with ``rollout`` on the same device (see the Note)."""
    fixed = sum(plan.buffers.get(name, 0) for name in FIXED_BUFFERS)
    fragmentation = plan.buffers.get(FRAGMENTATION, 0)
    rate = fragmentation / max(plan.total - fragmentation, 1)
    between_steps = plan.params + plan.optimizer_states + (plan.grads if keeps_grads else 0) + fixed
    kv_at_sync = rollout.kv_cache if request.sleep == "none" else 0
    generate = between_steps + rollout.weights + rollout.kv_cache + rollout.activations
    sync = between_steps + rollout.weights + kv_at_sync + rollout.sync_bucket
    train = plan.total + round(rollout.during_training(request.sleep) * (1 + rate))
    return ColocatedPlan(plan.name, train, round(generate * (1 + rate)), round(sync * (1 + rate)), usable)


def colocated_rl(estimate: "Estimate", request: RolloutRequest) -> ColocatedRL:
    """Each plan of ``estimate`` with a rollout engine on the same device (``memory-estimator --rollout-...``)."""
    rollout = rollout_terms(estimate.stats, request)
    usable = usable_bytes(estimate.device, estimate.setup.safety_margin)
    keeps_grads = not estimate.setup.zero_grad_to_none
    return ColocatedRL(request, rollout, tuple(colocated_plan(plan, rollout, request, usable, keeps_grads)
                                               for plan in estimate.plans))
