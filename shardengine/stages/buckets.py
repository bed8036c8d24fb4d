"""Where parameters live between uses at stages 0-2: whole flat buckets on every rank.

:class:`WholeBuckets` is the layout collaborator of stages 0-2 (stage 3's is
:class:`~shardengine.stages.unit_scheduler.UnitScheduler`): it plans the buckets at wrap,
grows them when the trainable set grows, and says what backward reduces (every
trainable bucket, in bucket order). :class:`BucketFactory` (``new_bucket``,
``finish_bucket``, ``place_master``) builds one bucket for either layout. Both
layouts are wired from :class:`~shardengine.stages.layout_sources.LayoutSources`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

from ..distributed.hybrid import HybridCommunicator
from ..distributed.work import Work
from ..flat.bucket import FlatBucket
from ..flat.layout import split_into_buckets
from ..flat.plan import UnitCuts, plan_replicated_buckets
from ..flat.storage import StoragePlan
from ..memory import nbytes
from .devices import device_of
from .layout_sources import BucketPolicy, LayoutSources

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


class BucketFactory:
    """Builds one flat bucket, for either layout, from the engine's bucket policy."""

    def __init__(self, comm: HybridCommunicator, policy: BucketPolicy):
        self.comm, self.policy = comm, policy

    def new_bucket(self, params: list[nn.Parameter], group_index, device,
                   storage: Optional[StoragePlan] = None) -> FlatBucket:
        """One flat bucket, laid out over the shard group (all ranks unless hybrid, see
        distributed/hybrid.py); ``storage``: its unit's plan (default the engine's, see
        flat/residency.py for units of either tier)."""
        policy = self.policy
        whole = group_index in policy.whole_tensor_groups and params[0].requires_grad
        layout = policy.layouts.layout([tuple(p.shape) for p in params], whole, steps_whole=policy.steps_whole)
        bucket = FlatBucket(params, group_index, self.comm.shard.rank, self.comm.group_size, device,
                            steps_whole=policy.steps_whole, whole_tensor=whole, layout=layout)
        storage = storage or policy.storage
        bucket.param_home, bucket.grad_home = storage.param_device, storage.grad_device
        return bucket

    def storage_of(self, bucket: FlatBucket) -> StoragePlan:
        """The storage plan ``bucket`` was built with: its unit's tier (flat/residency.py)."""
        return self.policy.storage.of(offloaded=bucket.param_home is not None)

    def separate_master_in(self, storage: StoragePlan) -> bool:
        """A bucket with this storage plan steps an fp32 master apart from its parameters."""
        return self.policy.mixed_precision or storage.separate_master

    def place_master(self, bucket: FlatBucket) -> None:
        """Split off the bucket's master on its storage plan's tier (the disk tier then moves it
        into a file, offload/disk_tier.py)."""
        storage = self.storage_of(bucket)
        bucket.make_master(separate=self.separate_master_in(storage), device=storage.master_device)
        if self.policy.disk is not None:
            self.policy.disk.place_master(bucket)

    def finish_bucket(self, bucket: FlatBucket) -> None:
        """Sync from rank 0, split off the fp32 master, cast to the compute dtype."""
        self.comm.broadcast(bucket.full_param)  # all ranks start from rank 0's weights
        if self.policy.rebuilds_optimizer and bucket.requires_grad:
            self.place_master(bucket)
        bucket.cast_params(self.policy.param_dtype)
        self.set_grad_dtype(bucket)

    def set_grad_dtype(self, bucket: FlatBucket) -> None:
        """The bucket's gradient dtype: ``reduce_dtype``, else ``param_dtype``, else its own."""
        bucket.grad_dtype = self.policy.grad_dtype or bucket.dtype


class WholeBuckets:
    """Stages 0-2: every rank holds every bucket whole; backward reduces bucket by bucket."""

    def __init__(self, sources: LayoutSources):
        self.sources = sources
        self.factory = BucketFactory(sources.comm, sources.policy)

    @classmethod
    def wire(cls, sources: LayoutSources) -> "WholeBuckets":
        return cls(sources)

    def make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        sources = self.sources
        device = device_of(sources.module)
        policy = sources.policy
        whole = frozenset() if policy.steps_whole else policy.whole_tensor_groups  # stage 0 steps all
        stage3 = sources.stage3
        cuts = UnitCuts(stage3.wrap, stage3.wrap_min_params) if sources.buckets_end_at_units else None
        buckets = []
        for plan in plan_replicated_buckets(sources.module, group_of, sources.bucket_bytes, whole,
                                            sources.comm.group_size, unit_cuts=cuts):
            bucket = self.factory.new_bucket(plan.params, plan.group_index, device)
            self.factory.finish_bucket(bucket)
            buckets.append(bucket)
        return buckets

    def broadcast_rest(self) -> None:
        """Frozen parameters (cast to the compute dtype) and buffers, from rank 0."""
        sources = self.sources
        param_dtype = sources.policy.param_dtype
        bucketed = {id(p) for b in sources.buckets() for p in b.params}
        for param in sources.module.parameters():
            if id(param) not in bucketed and param.numel() > 0:
                sources.comm.broadcast(param.data)
                if param_dtype is not None and param.is_floating_point():
                    param.data = param.data.to(param_dtype)
        for buffer in sources.module.buffers():
            if buffer.numel() > 0:
                sources.comm.broadcast(buffer)

    def grow_plan(self, newly: list[nn.Parameter], group_of: dict[int, int]) -> list[FlatBucket]:
        """Parameters trainable since the plan (stages/replan.py): frozen ones are held whole
        on every rank, outside any bucket and in the compute dtype, so they get buckets of their
        own, by (group, dtype) and size-capped like shard()'s plan; each is appended to the
        engine's plan (``sources.buckets()`` is that list)."""
        sources, factory = self.sources, self.factory
        order = {id(p): i for i, p in enumerate(sources.module.parameters())}
        newly = sorted(newly, key=lambda p: -order[id(p)])  # reverse registration, as at wrap
        by_key: dict[tuple, list[nn.Parameter]] = {}
        for param in newly:
            by_key.setdefault((group_of.get(id(param)), param.dtype), []).append(param)
        buckets = []
        device = sources.sync_device()
        plan = sources.buckets()
        for (group, _), same in by_key.items():
            elements = max(1, sources.bucket_bytes // same[0].element_size())
            for indices in split_into_buckets([p.numel() for p in same], elements):
                bucket = factory.new_bucket([same[i] for i in indices], group, device)
                if sources.policy.rebuilds_optimizer:
                    factory.place_master(bucket)
                factory.set_grad_dtype(bucket)
                plan.append(bucket)
                buckets.append(bucket)
        return buckets

    def register_hooks(self) -> "list[RemovableHandle]":
        return []  # the root's hooks and the gradient hooks are all it needs

    # ---- what backward reduces: every trainable bucket, as it completes

    def reduction_order(self) -> list:
        return list(self.sources.buckets())

    def item_of(self, bucket: FlatBucket) -> FlatBucket:
        return bucket

    def expected_grads(self, bucket: FlatBucket) -> int:
        return len(bucket.params)

    def launch(self, bucket: FlatBucket) -> list[Work]:
        return self.sources.grads.launch(bucket)

    def after_arrival(self, bucket: FlatBucket) -> None:
        pass

    def begin_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def param_bytes(self) -> int:
        buckets = self.sources.buckets()
        bucketed = {id(p) for b in buckets for p in b.params}
        loose = sum(nbytes(p) for p in self.sources.module.parameters() if id(p) not in bucketed)
        return loose + sum(nbytes(b.full_param) for b in buckets)

