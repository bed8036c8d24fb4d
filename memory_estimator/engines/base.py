"""What every engine model returns: model states and named buffers, by the moment they live.

[Note: the peak is a max over moments]
A training step has three candidate peaks. At the end of forward (start of backward)
the activations and the logits are all alive; while backward recomputes the first
checkpointed layer the logits are already freed; at the optimizer step the
activations are gone but every gradient and the step's temporaries exist. An engine
says which of its buffers live at which moment; ``plans.py`` takes the max. An engine
may name a fourth: the head's fetch at the very end of forward, every activation alive
but no logits yet (``before_logits``).

Gradients are ``transient`` when they are created during backward and freed by
``zero_grad(set_to_none=True)`` after the step (torch's default since 2.0): DDP's
``param.grad``, FSDP2's sharded gradients. They are then counted at the step, not at
the end of forward. Engines that keep flat gradient buffers (shardengine, DeepSpeed's
partitions) hold them all the time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol

from ..terms.model_states import PlanSpec
from ..terms.optimizers import state_bytes_per_element
from ..terms.precision import FP32_BYTES, Precision
from ..model.stats import ModelStats


@dataclass(frozen=True)
class EngineContext:
    """Everything an engine model needs about the model and the run."""

    stats: ModelStats
    world_size: int
    policy: Precision
    optimizer: str
    implementation: str          # "foreach", "fused" or "plain"
    prefetch: int = 1
    bucket_bytes: int = 25 * 2**20
    shard_numel_per_rank: int | None = None
    reshard_after_forward: bool = True  # shardengine stage 3: False keeps every unit gathered until its backward

    @property
    def psi(self) -> int:
        return self.stats.params

    @property
    def shard(self) -> int:
        """Elements one rank owns: the engine's exact count when known, else ``ceil(Ψ/N)``."""
        if self.shard_numel_per_rank is not None:
            return self.shard_numel_per_rank
        return math.ceil(self.psi / self.world_size)

    @property
    def state_bytes(self) -> int:
        """Optimizer state per element in the run's state dtype, no master."""
        return state_bytes_per_element(self.optimizer, self.policy.state_bytes)

    @property
    def fp32_state_bytes(self) -> int:
        """Optimizer state per element when the step runs over fp32 masters (offload)."""
        return state_bytes_per_element(self.optimizer, FP32_BYTES)

    def factored_bytes(self, sharded: bool) -> int:
        """Optimizer state not proportional to Ψ, sharded like the other states: Adafactor's
        factored statistics (rows + cols); the Muon recipe's AdamW second moment on the
        parameters outside the blocks (embeddings, head; Muon's one slot covers the rest)."""
        if self.optimizer == "adafactor":
            total = self.policy.state_bytes * self.stats.factored_state_numel
        elif self.optimizer == "muon-adamw":
            total = self.policy.state_bytes * min(self.stats.outside_params or 0, self.stats.params)
        else:
            return 0
        return math.ceil(total / self.world_size) if sharded else total

    @property
    def largest_unit(self) -> int:
        return self.stats.largest_unit if self.stats.largest_unit is not None else self.psi

    @property
    def largest_tensor(self) -> int:
        if self.stats.largest_tensor is not None:
            return self.stats.largest_tensor
        return self.largest_unit


@dataclass(frozen=True)
class EngineTerms:
    """Per-rank bytes of one plan under one engine.

    ``params``/``grads``/``optimizer_states`` are what the engine holds on the device
    (gradients: all of them, at the step). The buffers are named so a report can say
    what they are: ``persistent`` live all the time, ``forward`` with the activations
    (gathered units, buckets being filled), ``step`` at the optimizer step. ``host``
    is what the plan keeps in host RAM per rank, ``disk`` what it keeps in files
    (shardengine's ``offload_optimizer="disk"``). ``cached``: segments the caching allocator
    keeps from another moment that the forward's tensors are not carved from (DeepSpeed's
    flat step buffers): ``max_memory_reserved`` and nvidia-smi count them, allocated does not.
    """

    params: int
    grads: int
    optimizer_states: int
    grads_transient: bool = False
    persistent: Mapping[str, int] = field(default_factory=dict)
    forward: Mapping[str, int] = field(default_factory=dict)
    step: Mapping[str, int] = field(default_factory=dict)
    host: Mapping[str, int] = field(default_factory=dict)
    disk: Mapping[str, int] = field(default_factory=dict)
    cached: Mapping[str, int] = field(default_factory=dict)   # reserved, not allocated, beside a forward peak
    cached_carvable: int = 0   # a cached segment the forward's tensors are carved from: beside them only past them
    # alive at the end of forward only until the logits exist (the head's fetch): a moment of its own,
    # beside the activations and the forward's buffers but not the logits
    before_logits: Mapping[str, int] = field(default_factory=dict)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


class EngineMemoryModel(Protocol):
    """A training engine's memory model: the plans it can run and their terms."""

    name: str
    plans: tuple[PlanSpec, ...]
    hybrid_stages: tuple[int, ...]  # the stages it shards within groups of ranks (hybrid sharding)

    def terms(self, plan: PlanSpec, context: EngineContext) -> EngineTerms: ...


def keeps_linear_inputs(engine: EngineMemoryModel, plan: PlanSpec) -> bool:
    """Whether the engine makes every linear keep its input under this plan, frozen or not
    (DeepSpeed's ``zero.Init`` linear, ``deepspeed.py``); torch's own linear does not."""
    method = getattr(engine, "keeps_linear_inputs", None)
    return bool(method(plan)) if method is not None else False


def nonzero(**buffers: int) -> dict[str, int]:
    """The named buffers that are not empty (reports list only what exists)."""
    return {name: int(size) for name, size in buffers.items() if size}
