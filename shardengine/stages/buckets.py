"""Where parameters live between uses at stages 0-2: whole flat buckets on every rank.

:class:`WholeBuckets` is the layout collaborator of stages 0-2 (stage 3's is
:class:`~shardengine.stages.units.UnitScheduler`): it plans the buckets at wrap,
grows them when the trainable set grows, and says what backward reduces (every
trainable bucket, in bucket order). ``new_bucket`` and ``finish_bucket`` build one
bucket for either layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

from ..distributed.work import Work
from ..flat.bucket import FlatBucket
from ..flat.layout import split_into_buckets
from ..flat.plan import UnitCuts, plan_replicated_buckets
from ..flat.storage import StoragePlan
from ..memory import nbytes
from .devices import device_of

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .engine import StageEngine


def new_bucket(engine: "StageEngine", params: list[nn.Parameter], group_index, device,
               storage: Optional[StoragePlan] = None) -> FlatBucket:
    """One flat bucket, laid out over the shard group (all ranks unless hybrid, see
    distributed/hybrid.py); ``storage``: its unit's plan (default the engine's, see
    flat/residency.py for units of either tier)."""
    steps_whole = engine.spec.steps_whole
    whole = group_index in engine.whole_tensor_groups and params[0].requires_grad
    layout = engine.layouts.layout([tuple(p.shape) for p in params], whole, steps_whole=steps_whole)
    bucket = FlatBucket(params, group_index, engine.comm.shard.rank, engine.comm.group_size, device,
                        steps_whole=steps_whole, whole_tensor=whole, layout=layout)
    storage = storage or engine.storage
    bucket.param_home, bucket.grad_home = storage.param_device, storage.grad_device
    return bucket


def place_master(engine: "StageEngine", bucket: FlatBucket) -> None:
    """Split off the bucket's master on its storage plan's tier (the disk tier then moves it
    into a file, offload/disk_tier.py)."""
    storage = engine.storage_of(bucket)
    bucket.make_master(separate=engine.separate_master_in(storage), device=storage.master_device)
    if engine.disk is not None:
        engine.disk.place_master(bucket)


def finish_bucket(engine: "StageEngine", bucket: FlatBucket) -> None:
    """Sync from rank 0, split off the fp32 master, cast to the compute dtype."""
    engine.comm.broadcast(bucket.full_param)  # all ranks start from rank 0's weights
    if engine.stepping.rebuilds_optimizer and bucket.requires_grad:
        place_master(engine, bucket)
    bucket.cast_params(engine.config.param_dtype)
    bucket.grad_dtype = engine.grad_dtype or bucket.dtype


class WholeBuckets:
    """Stages 0-2: every rank holds every bucket whole; backward reduces bucket by bucket."""

    def __init__(self, engine: "StageEngine"):
        self.engine = engine

    def make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        engine = self.engine
        device = device_of(engine.module)
        whole = frozenset() if engine.spec.steps_whole else engine.whole_tensor_groups  # stage 0 steps all
        config = engine.config
        cuts = UnitCuts(config.wrap, config.wrap_min_params) if engine.spec.buckets_end_at_units else None
        buckets = []
        for plan in plan_replicated_buckets(engine.module, group_of, config.bucket_bytes, whole,
                                            engine.comm.group_size, unit_cuts=cuts):
            bucket = new_bucket(engine, plan.params, plan.group_index, device)
            finish_bucket(engine, bucket)
            buckets.append(bucket)
        return buckets

    def broadcast_rest(self) -> None:
        """Frozen parameters (cast to the compute dtype) and buffers, from rank 0."""
        engine = self.engine
        bucketed = {id(p) for b in engine.buckets for p in b.params}
        for param in engine.module.parameters():
            if id(param) not in bucketed and param.numel() > 0:
                engine.comm.broadcast(param.data)
                if engine.config.param_dtype is not None and param.is_floating_point():
                    param.data = param.data.to(engine.config.param_dtype)
        for buffer in engine.module.buffers():
            if buffer.numel() > 0:
                engine.comm.broadcast(buffer)

    def grow_plan(self, newly: list[nn.Parameter], group_of: dict[int, int]) -> list[FlatBucket]:
        """Parameters trainable since the plan (stages/replan.py): frozen ones are held whole
        on every rank, outside any bucket and in the compute dtype, so they get buckets of their
        own, by (group, dtype) and size-capped like shard()'s plan."""
        engine = self.engine
        order = {id(p): i for i, p in enumerate(engine.module.parameters())}
        newly = sorted(newly, key=lambda p: -order[id(p)])  # reverse registration, as at wrap
        by_key: dict[tuple, list[nn.Parameter]] = {}
        for param in newly:
            by_key.setdefault((group_of.get(id(param)), param.dtype), []).append(param)
        buckets = []
        device = engine.forward.sync_device()
        for (group, _), same in by_key.items():
            elements = max(1, engine.config.bucket_bytes // same[0].element_size())
            for indices in split_into_buckets([p.numel() for p in same], elements):
                bucket = new_bucket(engine, [same[i] for i in indices], group, device)
                if engine.stepping.rebuilds_optimizer:
                    place_master(engine, bucket)
                bucket.grad_dtype = engine.grad_dtype or bucket.dtype
                engine.buckets.append(bucket)
                buckets.append(bucket)
        return buckets

    def register_hooks(self) -> "list[RemovableHandle]":
        return []  # the root's hooks and the gradient hooks are all it needs

    # ---- what backward reduces: every trainable bucket, as it completes

    def reduction_order(self) -> list:
        return list(self.engine.buckets)

    def item_of(self, bucket: FlatBucket) -> FlatBucket:
        return bucket

    def expected_grads(self, bucket: FlatBucket) -> int:
        return len(bucket.params)

    def launch(self, bucket: FlatBucket) -> list[Work]:
        return self.engine.grads.launch(bucket)

    def after_arrival(self, bucket: FlatBucket) -> None:
        pass

    def begin_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def param_bytes(self) -> int:
        engine = self.engine
        bucketed = {id(p) for b in engine.buckets for p in b.params}
        loose = sum(nbytes(p) for p in engine.module.parameters() if id(p) not in bucketed)
        return loose + sum(nbytes(b.full_param) for b in engine.buckets)

