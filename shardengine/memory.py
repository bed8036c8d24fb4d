"""Per-rank memory accounting: what the engine holds, by category."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch


def nbytes(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class LiveBytes:
    """Bytes of transient buffers alive now, and the most seen at once."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, count: int) -> None:
        self.current += count
        self.peak = max(self.peak, self.current)

    def sub(self, count: int) -> None:
        self.current -= count

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank holds, by category.

    ``optimizer_states`` includes fp32 master weights when they are a separate
    copy; ``comm_buffers`` are transient buffers alive now (gathered stage-3
    parameters, gradient buckets in flight), ``peak_comm_buffers`` the most
    alive at once since the last reset. With ``offload_optimizer`` the master
    weights and optimizer state live in host memory: ``host_optimizer_states``.
    With ``offload_optimizer="disk"`` the master weights and the optimizer state
    shaped like them live in files: ``disk_optimizer_states`` (between steps none
    of it is in memory; during the step at most three buckets' worth is, see
    shardengine/offload/disk_tier.py); the rest of the state (scalars such as
    Adam's step counts) stays in ``host_optimizer_states``.
    With ``offload_params`` (stage 3) the kept parameter shards and the reduced
    gradient shards live in host memory too: ``host_params``, ``host_grads``; with a
    fraction or a device budget, those of the units moved to the host; with
    ``offload_params="disk"`` the parameter shards live in files instead:
    ``disk_params`` (a frozen bucket's shard; a trained bucket's only shard is its
    fp32 master, in ``disk_optimizer_states``), the gradient shards in ``host_grads``.
    ``params``, ``grads`` and ``optimizer_states`` are always the device's bytes.

    ``activations`` are the bytes autograd keeps for backward on the device now
    (each storage once; parameters never), ``peak_activations`` the most kept at once
    since the previous ``memory_report()``, a checkpointed block's recomputation
    included; ``host_activations`` / ``peak_host_activations`` the same for what
    activation offload moved to host memory. Measured through saved-tensor hooks
    (shardengine/activations/ledger.py), not estimated; a forward whose saved tensors
    the user's own ``saved_tensors_hooks`` took is not counted.
    """

    params: int
    grads: int
    optimizer_states: int
    comm_buffers: int = 0
    peak_comm_buffers: int = 0
    host_optimizer_states: int = 0
    disk_optimizer_states: int = 0
    host_params: int = 0
    host_grads: int = 0
    disk_params: int = 0
    activations: int = 0
    peak_activations: int = 0
    host_activations: int = 0
    peak_host_activations: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def host_model_states(self) -> int:
        """Bytes of model states in host memory (the disk tier's files not counted)."""
        return self.host_params + self.host_grads + self.host_optimizer_states

    @property
    def total(self) -> int:
        return self.model_states + self.comm_buffers

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}
