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
    With ``offload_params`` (stage 3) the parameter shards and the reduced gradient
    shards live in host memory too: ``host_params``, ``host_grads``; a trained
    bucket's only parameter shard is then its fp32 master, counted in ``host_params``
    (numel x 4 bytes, as a resident fp32 shard is in ``params``), and
    ``host_optimizer_states`` is the optimizer's own state alone. With a fraction or a
    device budget, the same for the units moved to the host; with
    ``offload_params="disk"`` the parameter shards (a frozen bucket's, and a trained
    bucket's master) live in files instead: ``disk_params``, the optimizer's state in
    ``disk_optimizer_states``, the gradient shards in ``host_grads``.
    ``params``, ``grads`` and ``optimizer_states`` are always the device's bytes.

    ``activations`` are the bytes autograd keeps for backward on the device now
    (each storage once; parameters never), ``peak_activations`` the most kept at once
    since the previous ``memory_report()``, a checkpointed block's recomputation
    included; ``host_activations`` / ``peak_host_activations`` the same for what
    activation offload moved to host memory. Measured through saved-tensor hooks
    (shardengine/activations/ledger.py), not estimated; a forward whose saved tensors
    the user's own ``saved_tensors_hooks`` took is not counted. They are measured only
    when asked for (``measure_activations=True``, ``se.Activations(measure=True)``) or
    with activation checkpointing or offload on; otherwise all four are None (not
    measured: the hooks would cost every step a Python call per saved tensor).

    >>> print(MemoryReport(params=4096, grads=0, optimizer_states=8192))
    params 4,096 B, grads 0 B, optimizer_states 8,192 B, comm_buffers 0 B (peak 0 B); activations not measured (se.Activations(measure=True))
    >>> print(MemoryReport(params=0, grads=0, optimizer_states=0, host_params=4096, activations=0, peak_activations=512))
    params 0 B, grads 0 B, optimizer_states 0 B, comm_buffers 0 B (peak 0 B), host_params 4,096 B; activations 0 B (peak 512 B)
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
    activations: Optional[int] = None
    peak_activations: Optional[int] = None
    host_activations: Optional[int] = None
    peak_host_activations: Optional[int] = None

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

    @property
    def activations_measured(self) -> bool:
        return self.peak_activations is not None

    def as_dict(self) -> dict[str, Optional[int]]:
        """Every field (the activation ones None when not measured), ``model_states`` and ``total``."""
        return {**asdict(self), "model_states": self.model_states, "total": self.total}

    def __str__(self) -> str:
        """The categories in bytes: the device's always, the host's and disk's where non-zero."""
        text = ", ".join([f"{name} {getattr(self, name):,} B" for name in ("params", "grads", "optimizer_states")]
                         + [f"comm_buffers {self.comm_buffers:,} B (peak {self.peak_comm_buffers:,} B)"]
                         + [f"{name} {getattr(self, name):,} B" for name in _OFF_DEVICE if getattr(self, name)])
        if not self.activations_measured:
            return text + "; activations not measured (se.Activations(measure=True))"
        text += f"; activations {self.activations:,} B (peak {self.peak_activations:,} B)"
        if self.peak_host_activations:
            text += f", host_activations {self.host_activations:,} B (peak {self.peak_host_activations:,} B)"
        return text


_OFF_DEVICE = ("host_params", "host_grads", "host_optimizer_states", "disk_params", "disk_optimizer_states")
