"""Where a bucket's training state lives: the storage-tier seam.

[Note: storage tiers]
Each bucket (flat/bucket.py) holds three kinds of training state: the
parameters (``full_param`` / ``kept_shard``, in the compute dtype), the
gradients (``full_grad`` / ``grad_shard``) and what the optimizer steps (the
fp32 ``master`` slice and the optimizer's state, created over the master's
pieces). :class:`StoragePlan` names one :class:`Tier` per kind, chosen once at
``shard()`` from the config, and the engine asks it instead of reading
``config.offload_optimizer`` at each call site:

* ``StoragePlan.master_device`` -- where ``FlatBucket.make_master`` puts the
  master (stages/buckets.py, ``finish_bucket``, and the layouts' ``grow_plan``
  when the trainable set grows after ``shard()``); the optimizer is re-pointed at
  views of it, so its state is created on the same tier and the step runs
  there (ZeRO-Offload's CPU step);
* ``StoragePlan.separate_master`` -- a master on another tier than the
  parameters cannot share their storage (stages/engine.py, ``separate_master``);
* ``StoragePlan.split_by_tier`` -- how ``memory_report()`` splits device from host
  bytes (stages/reports.py).

The optimizer's kind can leave the device (``Offload(optimizer=True)``), and at
stage 3 the parameters and gradients with it (``Offload(params=True)``): then the
trainable buckets' parameter shard *is* the host master (stage 3 keeps no
compute copy beside it, see [Note: no compute copy beside a master] in
flat/bucket.py), a frozen bucket's kept shard moves to the host
(``StoragePlan.param_device``), and each reduced gradient shard is copied to the
host as it is kept (``StoragePlan.grad_device``, ``FlatBucket.grad_home``).
A new tier or kind plugs in here and into the one engine collaborator that owns
the bytes it moves (stages/recipes.py picks them per stage): parameters
offloaded to host (or disk) are fetched where the stage-3 ``UnitScheduler``
gathers a unit (``gather_bucket``, stages/unit_scheduler.py) and released where it frees
one (``free``), and at stages 1-2 where ``GatherAfterStep`` publishes the
stepped slices (stages/publication.py); gradients offloaded after their
reduction are moved where a gradient path keeps the reduced slice (the
``_keep`` of each class in stages/gradients.py) and brought back by
``FlatBucket.master_grad`` (which already converts to the master's device).
With a fraction or a budget (``Offload(params=0.5)``, ``Offload(device_budget=...)``)
the plan above is that of the offloaded units, and ``StoragePlan.resident`` that
of the units kept on the device (flat/residency.py chooses them): each bucket is
built with its unit's plan (``StoragePlan.of``), and ``FlatBucket.param_home``
(set only for an offloaded unit's bucket) says afterwards which one it got.
The disk tier (``Offload(optimizer="disk")``, ``Tier.DISK``) keeps the same
master and state in files (offload/disk_tier.py): the master is made on the host
as for ``Tier.HOST`` and then moved into a file by the engine's ``DiskTier``
(stages/buckets.py ``place_master``); the step runs on the CPU bucket by bucket.
With ``Offload(params="disk")`` (stage 3) the parameters follow the master into
files (``Tier.DISK`` for both): a frozen bucket's kept shard is made on the host
and moved into a file as the master is, and ``DiskParams``
(offload/disk_params.py) reads each unit's files in ahead of its gather and drops
them after; the reduced gradients stay on the host (``Tier.HOST``) until the step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # flat/ sits below config (tests/architecture/test_package_boundaries.py)
    from ..config import ShardConfig


class Tier(enum.Enum):
    """A memory tier that can hold training state."""

    DEVICE = "device"  # the model's device (a GPU, or the CPU in a CPU-only run)
    HOST = "host"      # host memory (pinned when a GPU is present)
    DISK = "disk"      # files under Offload.path, mapped into host memory a bucket at a time


@dataclass(frozen=True)
class StoragePlan:
    """The tier of each kind of training state (see the module's Note).

    >>> from shardengine.config import ShardConfig
    >>> plan = StoragePlan.from_config(ShardConfig(stage=2, offload_optimizer=True))
    >>> plan.optimizer, plan.master_device, plan.separate_master
    (<Tier.HOST: 'host'>, device(type='cpu'), True)
    >>> StoragePlan.from_config(ShardConfig(stage=2)).master_device is None
    True
    """

    params: Tier = Tier.DEVICE
    grads: Tier = Tier.DEVICE
    optimizer: Tier = Tier.DEVICE  # the fp32 master slice and the optimizer's state
    resident: Optional["StoragePlan"] = None  # a fraction or budget: the plan of the units kept on the device

    @classmethod
    def from_config(cls, config: "ShardConfig") -> "StoragePlan":
        if config.offload.params_on_disk:  # the reduced gradients wait for the step in host memory
            return cls(params=Tier.DISK, grads=Tier.HOST, optimizer=Tier.DISK)
        if config.offload.on_disk:
            return cls(optimizer=Tier.DISK)
        if config.offload.partial_params:  # resident units keep the optimizer where it was asked for
            return cls(params=Tier.HOST, grads=Tier.HOST, optimizer=Tier.HOST,
                       resident=cls(optimizer=Tier.HOST if config.offload_optimizer else Tier.DEVICE))
        if config.offload_params:
            return cls(params=Tier.HOST, grads=Tier.HOST, optimizer=Tier.HOST)
        return cls(optimizer=Tier.HOST if config.offload_optimizer else Tier.DEVICE)

    def of(self, offloaded: bool) -> "StoragePlan":
        """The plan of a unit (of its buckets): this one, or ``resident``'s for a unit kept on the device."""
        return self if offloaded or self.resident is None else self.resident

    @property
    def master_device(self) -> Optional[torch.device]:
        """Where the master goes; None: beside the parameters."""
        return torch.device("cpu") if self.optimizer in (Tier.HOST, Tier.DISK) else None

    @property
    def param_device(self) -> Optional[torch.device]:
        """Where a kept parameter shard lives between gathers; None: beside the full buffer."""
        return torch.device("cpu") if self.params in (Tier.HOST, Tier.DISK) else None

    @property
    def grad_device(self) -> Optional[torch.device]:
        """Where a reduced gradient shard is kept; None: where it was reduced."""
        return torch.device("cpu") if self.grads is Tier.HOST else None

    @property
    def separate_master(self) -> bool:
        """The master lives off the device, where the compute buffer always is, so it is a copy
        of its own (with the parameters on the host too, it is their only copy there)."""
        return self.optimizer is not Tier.DEVICE

    def split_by_tier(self, tier_of: Tier, nbytes: int) -> tuple[int, int]:
        """``(device bytes, host bytes)`` of ``nbytes`` kept on ``tier_of``."""
        return (nbytes, 0) if tier_of is Tier.DEVICE else (0, nbytes)  # the disk tier's rest is on the host
