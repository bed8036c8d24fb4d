"""What the layouts (buckets.py, unit_scheduler.py) receive from the engine that wires them.

``StageEngine.__init__`` builds one :class:`LayoutSources` and hands it to the
stage's layout class (``recipe.layout.wire(sources)``), as it does for the
publication (publication.py). The sources come in three parts, by who reads them:

* :class:`BucketPolicy` -- how every bucket is laid out, typed and stored, the same
  at every stage (``BucketFactory`` in buckets.py builds buckets from it);
* :class:`LayoutSources` -- what both layouts read: the module, the communicator,
  the plan as it is now, the unit policy (``Stage3``: stage 2 cuts buckets at its
  units), the gradient path they launch reductions on;
* :class:`UnitSources` -- what only stage 3's :class:`~shardengine.stages.unit_scheduler.UnitScheduler`
  reads: the step's phase, the live bytes, the partners it calls while a pass runs.

Callables stand for what the engine replaces or makes after the layout: the plan
grows (replan.py), compression and the reducer are made from the layout's buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Protocol

import torch
from torch import nn

from ..distributed.compression.collectives import CompressedCollectives
from ..distributed.hybrid import HybridCommunicator
from ..distributed.work import Work
from ..flat.bucket import Buckets, FlatBucket
from ..flat.storage import StoragePlan
from ..memory import LiveBytes
from ..offload.disk_params import DiskParams
from ..offload.disk_tier import DiskTier
from ..optim.whole_tensor import BucketLayouts
from ..policies import Offload, Stage3
from ..step.phase import StepState


class GradientLaunch(Protocol):
    """What a layout asks of the stage's gradient path (gradients.py): reduce one bucket."""

    def launch(self, bucket: FlatBucket) -> list[Work]: ...


class UsableCheck(Protocol):
    """What stage 3 asks of the failure handling (failure.py)."""

    def check_usable(self) -> None: ...

    def fail(self, what: str) -> None: ...


class BackwardStart(Protocol):
    """What stage 3 asks of the backward hooks (backward.py): a unit's output gradient came."""

    def begin_backward(self) -> None: ...


@dataclass(frozen=True)
class BucketPolicy:
    """How each flat bucket is laid out, typed and stored (buckets.py ``BucketFactory``)."""

    layouts: BucketLayouts                # owners of whole-tensor buckets (optim/whole_tensor.py)
    storage: StoragePlan                  # which tier holds what (flat/storage.py)
    whole_tensor_groups: frozenset[int]   # param groups whose optimizer needs whole parameters
    steps_whole: bool                     # StageSpec: every rank steps whole buckets (stage 0)
    mixed_precision: bool                 # an fp32 master beside compute-dtype parameters
    param_dtype: Optional[torch.dtype]    # the compute dtype (None: the parameters' own)
    grad_dtype: Optional[torch.dtype]     # the gradients' dtype (None: the bucket's)
    rebuilds_optimizer: bool              # stepping.py: the optimizer steps flat masters
    disk: Optional[DiskTier]              # the optimizer's files (offload/disk_tier.py)


@dataclass(frozen=True)
class UnitSources:
    """What stage 3's unit scheduler alone reads (unit_scheduler.py)."""

    offload: Offload                      # which units live on the host (stages/unit_tiers.py)
    sizing_optimizer: Optional[torch.optim.Optimizer]  # the user's, read to size a device budget
    step_state: StepState                 # the step's phase (step/phase.py)
    live: LiveBytes                       # gathered parameters count here while they live
    disk_params: Optional[DiskParams]     # shards in files (offload/disk_params.py)
    compression: Callable[[], Optional[CompressedCollectives]]  # made after the layout
    arrivals: Callable[[Hashable], int]   # gradients arrived for a unit (the reducer, made after)
    failure: UsableCheck
    backward: BackwardStart


@dataclass(frozen=True)
class LayoutSources:
    """What any layout may use; each class's ``wire`` takes what it needs."""

    module: nn.Module
    comm: HybridCommunicator
    buckets: Buckets                      # every bucket of the plan, as it is now
    policy: BucketPolicy
    bucket_bytes: int                     # stages 0-2: a bucket's size cap
    stage3: Stage3                        # the units (wrap), how stage 3 gathers them (prefetch, ...)
    buckets_end_at_units: bool            # StageSpec: stage 2 cuts its buckets at those units
    grads: GradientLaunch
    sync_device: Callable[[], torch.device]  # the model's device (forward.py)
    units: UnitSources
