"""Stage 3's layout and publication: parameters live as slices, each unit gathered around its use.

Every unit's buckets keep only this rank's slice (its fp32 master, or the
compute-dtype ``kept_shard`` where there is none: flat/bucket.py); a forward
pre-hook all-gathers the unit, a forward hook frees it again and hooks the
unit's outputs so that backward gathers it once more; when every gradient of
the unit has arrived (and its backward is over, unit_backward.py) it is freed
and its gradients are reduce-scattered. With ``prefetch`` the next units'
all-gathers are issued while the current one computes. :class:`UnitScheduler`
owns all of that; the engine calls it where stages 0-2 call
:class:`~shardengine.stages.buckets.WholeBuckets`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from ..distributed.work import Work
from ..flat.bucket import FlatBucket, host_copy
from ..flat.meta_init import MetaInit, check_meta_model
from ..flat.plan import BucketPlan, plan_unit_buckets
from ..flat.storage import StoragePlan, Tier
from ..flat.units import Unit, in_backward, root_entry_modules, root_frozen_modules, tensors_in
from ..memory import nbytes
from .buckets import BucketFactory
from .compile_support import eager_hook
from .devices import device_of
from .unit_tiers import ResidentUnitCost, offloaded_unit_indices
from .unit_backward import UnitBackwardTracker, when_backward_reaches
from .external import ExternalUses
from .layout_sources import LayoutSources
from ..step.call_agreement import ranks_named
from .unit_order import UnitOrder

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


class UnitScheduler:
    """Gather, free and prefetch units; reduce a unit's gradients once its backward is over."""

    def __init__(self, sources: LayoutSources):
        self.sources, self.unit_sources = sources, sources.units
        self.factory = BucketFactory(sources.comm, sources.policy)
        self.units: list[Unit] = []
        self.unit_of: dict[FlatBucket, Unit] = {}
        self.forward_order: list[Unit] = []         # units in this forward's order
        self.last_forward_order: list[Unit] = []    # ... and the last one's (prefetch follows it)
        self.pending_gathers: dict[Unit, list[Work]] = {}
        self.root_opened_by: Optional[nn.Module] = None  # a submodule called directly, see below
        self.unit_backward = UnitBackwardTracker(self.release_unit)
        self.open_pass: dict[Unit, object] = {}  # the running forward's pass, per unit
        self.root_module_passes: list = []  # passes the root's frozen modules opened in this forward
        self.meta_init: Optional[MetaInit] = None  # how meta tensors are filled, set with the first unit
        self.hold_budget: Optional[int] = None  # inside holding(): bytes of units kept gathered across forwards
        self.held: set[Unit] = set()
        # rounds before each collective: one order on every rank
        self.order = UnitOrder(sources.comm, sources.buckets, self.serve_bucket,
                               lambda bucket: self.unit_of[bucket].name)
        # units gathered for a use outside their forward
        self.external = ExternalUses(lambda: self.units, self.gather, self.free, self._in_forward,
                                     sources.units.failure.check_usable)

    @classmethod
    def wire(cls, sources: LayoutSources) -> "UnitScheduler":
        return cls(sources)

    def _in_forward(self) -> bool:
        """The model's forward runs (or a submodule called on its own)."""
        return bool(self.unit_sources.step_state.forward_depth) or self.root_opened_by is not None

    # ------------------------------------------------------------------ wrap time

    def make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        sources = self.sources
        stage3 = sources.stage3
        check_meta_model(sources.module)  # meta buffers are materialized with their unit; the rest refused
        planned = plan_unit_buckets(sources.module, group_of, stage3.wrap, stage3.wrap_min_params)
        offloaded = offloaded_unit_indices(  # a fraction or budget: flat/residency.py
            planned, self.unit_sources.offload, sources.comm.group_size, self._resident_unit_cost())
        for index, (module, name, plans) in enumerate(planned):
            storage = sources.policy.storage.of(offloaded=index in offloaded)
            self.units.append(Unit(module, name, self._make_unit_buckets(module, plans, storage)))
        self.unit_of = {bucket: unit for unit in self.units for bucket in unit.buckets}
        return [bucket for unit in self.units for bucket in unit.buckets]

    def _resident_unit_cost(self) -> ResidentUnitCost:
        """What a unit kept on the device holds, for a device budget (stages/unit_tiers.py)."""
        policy = self.sources.policy
        resident = policy.storage.of(offloaded=False)
        return ResidentUnitCost(policy.param_dtype, policy.grad_dtype, self.factory.separate_master_in(resident),
                                resident.optimizer is Tier.DEVICE, self.unit_sources.sizing_optimizer)

    def _make_unit_buckets(self, module: nn.Module, plans: list[BucketPlan],
                           storage: StoragePlan) -> list[FlatBucket]:
        """Pack, materialize, sync from rank 0, and shard one unit: peak = one unit."""
        root, disk_params = self.sources.module, self.unit_sources.disk_params
        device = device_of(root, allow_meta=True)
        meta_params = {id(p) for plan in plans for p in plan.params if p.is_meta}
        if self.meta_init is None:  # before the first unit is allocated: check (fail fast), draw adapters
            self.meta_init = MetaInit(root, self.sources.stage3.param_init_fn)
        buckets = [self.factory.new_bucket(plan.params, plan.group_index, device, storage) for plan in plans]
        self.meta_init.initialize_unit(module, meta_params, device)
        for bucket in buckets:
            self.factory.finish_bucket(bucket)
            bucket.shard_params()
            if disk_params is not None:  # the shard into a file (offload/disk_params.py)
                disk_params.place(bucket)
        return buckets

    def broadcast_rest(self) -> None:
        for buffer in self.sources.module.buffers():
            if buffer.numel() > 0:
                self.sources.comm.broadcast(buffer)

    def grow_plan(self, newly: list[nn.Parameter], group_of: dict[int, int]) -> list[FlatBucket]:
        """A frozen parameter already lives, sharded, in its unit's frozen bucket: that bucket
        trains from now on (stages/replan.py), in the param group shard() gave it."""
        factory, disk = self.factory, self.sources.policy.disk
        wanted = {id(p) for p in newly}
        grown = []
        for bucket in self.sources.buckets():
            if bucket.requires_grad or not any(id(p) in wanted for p in bucket.params):
                continue
            bucket.requires_grad = True
            if self.sources.policy.rebuilds_optimizer:
                storage = factory.storage_of(bucket)
                separate = factory.separate_master_in(storage)
                shard = bucket.kept_shard.detach()
                if separate:  # the master holds the values now: see [Note: no compute copy beside a master]
                    shard = host_copy(shard, storage.master_device or shard.device, torch.float32)
                    bucket.kept_shard = None
                bucket.master, bucket.master_is_separate = shard, separate
                if disk is not None:
                    disk.place_master(bucket)
            factory.set_grad_dtype(bucket)
            grown.append(bucket)
        return grown

    def register_hooks(self) -> "list[RemovableHandle]":
        self.order.enable()  # the engine is built: its collectives from now on follow the model
        self.external.attach()
        handles = []
        for unit in self.units:
            handles.append(unit.module.register_forward_pre_hook(eager_hook(
                lambda module, args, kwargs, unit=unit:
                    self.pre_forward(unit, args, kwargs) if module is unit.module else None),
                with_kwargs=True))
            handles.append(unit.module.register_forward_hook(eager_hook(
                lambda module, args, output, unit=unit:
                    self.post_forward(unit, output) if module is unit.module else None)))
        for module in root_entry_modules(self.sources.module, self.units):
            handles.append(module.register_forward_pre_hook(eager_hook(
                lambda module, args, owner=module: self.open_root_for(module, owner))))
            handles.append(module.register_forward_hook(eager_hook(
                lambda module, args, output, owner=module: self.close_root_for(module, owner, output))))
        for module in root_frozen_modules(self.sources.module, self.units):
            handles.append(module.register_forward_pre_hook(eager_hook(
                lambda module, args, kwargs: self._open_root_module_pass(args, kwargs)), with_kwargs=True))
        return handles

    def _open_root_module_pass(self, args, kwargs) -> None:
        """[Note: the root unit holds the other units]
        Every other unit runs inside the root's forward, so the root's backward is not one
        stretch: its head and final norm run first, its embedding last. A pass on the root's
        own inputs (token ids: none) cannot say when the frozen ones among them are done, and
        the root's trainable parameters (a head trained beside LoRA adapters: PEFT's
        modules_to_save) may all have their gradients before a frozen final norm has computed
        its input's gradient — the last block's — from its weight. So each frozen root module
        opens a pass of its own on its inputs, pending from the root's pre-backward (the first
        thing backward runs: AccumulateGrad runs before the norm's node, so the norm's own
        output gradient would come too late), closed once its input gradients are computed."""
        if self.units and not in_backward() and torch.is_grad_enabled() and self._in_forward():
            unit_pass = self.unit_backward.on_forward(self.units[-1], args, kwargs or {})
            if unit_pass is not None:
                self.root_module_passes.append(unit_pass)

    # ------------------------------------------------------------------ submodules called directly

    def open_root_for(self, module: nn.Module, owner: nn.Module) -> None:
        """A submodule holding root-unit parameters was called outside the model's forward
        (an encoder inside generate(), an embedding): gather the root unit for it.

        [Note: the root unit outside the root's forward]
        The root unit is normally gathered by the whole model's forward. A module
        below the root that is not a unit itself reads root-unit parameters (T5's
        shared embedding inside its encoder), so calling it directly must gather
        them too; the outermost such call opens the root unit and closes it (and
        sets up the re-gather for backward) when it returns.
        """
        root = self.units[-1]
        if module is not owner or self.root_opened_by is not None or self.unit_sources.step_state.forward_depth:
            return
        if all(b.full_params_live for b in root.buckets):
            return
        self.root_opened_by = owner
        self.pre_forward(root)

    def close_root_for(self, module: nn.Module, owner: nn.Module, output) -> None:
        if module is owner and self.root_opened_by is owner:
            self.root_opened_by = None
            self.post_forward(self.units[-1], output)

    # ------------------------------------------------------------------ gather / free

    def gather(self, unit: Unit) -> None:
        works = self.pending_gathers.pop(unit, None)
        if works is None:
            works = [self.gather_bucket(b) for b in unit.buckets if not b.full_params_live]
        for work in works:
            work.wait()

    def prefetch(self, units: list[Unit]) -> None:
        for unit in units:
            if unit not in self.pending_gathers:
                works = [self.gather_bucket(b) for b in unit.buckets if not b.full_params_live]
                if works:
                    self.pending_gathers[unit] = works

    def gather_bucket(self, bucket: FlatBucket) -> Work:
        return self.order.gather(bucket, lambda: self._gather_now(bucket))

    def serve_bucket(self, bucket: FlatBucket) -> None:
        """Take part in another rank's gather of ``bucket`` (unit_order.py): into this rank's own
        buffer (the same values where it holds the unit gathered), freed again unless it does."""
        for work in self.pending_gathers.get(self.unit_of[bucket], []):
            work.wait()
        held = bucket.full_params_live
        self._gather_now(bucket).wait()
        if not held:
            self.unit_sources.live.sub(nbytes(bucket.full_param))
            bucket.free_full_params()

    def _gather_now(self, bucket: FlatBucket) -> Work:
        unit_sources = self.unit_sources
        if not bucket.full_params_live:
            bucket.alloc_full_params()
            unit_sources.live.add(nbytes(bucket.full_param))
        disk = unit_sources.disk_params  # a shard in a file is read in for this and dropped after
        compression = unit_sources.compression()
        with disk.reading(bucket) if disk is not None else contextlib.nullcontext():
            if compression is not None and compression.params is not None \
                    and bucket.dtype.is_floating_point:  # an integer parameter is sent exact
                return compression.all_gather_params(bucket)
            return self.sources.comm.all_gather(bucket.full_param, bucket.fill_own_chunk(), async_op=True)

    def free(self, unit: Unit) -> None:
        for work in self.pending_gathers.pop(unit, []):
            work.wait()  # never free storage a collective is still writing
        for bucket in unit.buckets:
            if bucket.full_params_live:
                self.unit_sources.live.sub(nbytes(bucket.full_param))
                bucket.free_full_params()

    def _next_units(self, unit: Unit, order: list[Unit], count: int) -> list[Unit]:
        if unit not in order:
            return []
        start = order.index(unit) + 1
        return order[start:start + count]

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        """Gather the ``prefetch`` units after ``unit`` now; with the parameters on disk, have the
        one after those read in meanwhile (offload/disk_params.py)."""
        prefetch, disk_params = self.sources.stage3.prefetch, self.unit_sources.disk_params
        upcoming = self._next_units(unit, order, prefetch + 1)
        self.prefetch(upcoming[:prefetch])
        if disk_params is not None:
            disk_params.read_ahead(b for u in upcoming[prefetch:] for b in u.buckets)

    def _backward_order(self) -> list[Unit]:
        # The root's output gradient arrives first, then the blocks in reverse.
        order = self.forward_order
        return order[:1] + order[1:][::-1]

    def pre_forward(self, unit: Unit, args=(), kwargs=None) -> None:
        self.unit_sources.failure.check_usable()
        self.external.calls_open += 1
        if torch.is_grad_enabled() and unit not in self.forward_order:
            self.forward_order.append(unit)
        if unit.has_frozen:  # see [Note: a unit's backward ends with its input gradients]
            self.open_pass[unit] = self.unit_backward.on_forward(unit, args, kwargs or {})
        self.gather(unit)
        if not in_backward():
            self._prefetch_after(unit, self.last_forward_order)

    def post_forward(self, unit: Unit, output) -> None:
        self.external.left_call()
        passes = [self.open_pass.pop(unit, None)]
        if unit is self.units[-1] and not in_backward():  # [Note: the root unit holds the other units]
            passes, self.root_module_passes = passes + self.root_module_passes, []
        if torch.is_grad_enabled():
            # [Note: a unit's pre-backward comes last] (unit_backward.py); any object: flat/units.py
            for tensor in tensors_in(output, objects=True):
                if isinstance(tensor, nn.Parameter):
                    continue  # a module returning its own parameter: a hook there would stay for good
                when_backward_reaches(tensor, lambda unit=unit, passes=passes: self.pre_backward(unit, *passes))
        recomputing = in_backward()  # activation checkpointing: backward needs them now
        held = unit in self.external.held  # used outside its forward: kept for that use's backward
        reshards = self.sources.stage3.reshard_after_forward
        if not recomputing and not held and (reshards or not torch.is_grad_enabled()) \
                and not self._hold(unit):
            self.free(unit)
        if unit is self.units[-1] and not recomputing:
            for prefetched in list(self.pending_gathers):  # gathered ahead, then not called this time
                self.free(prefetched)
            self.external.forward_done()
            raised = self.order.forward_done()
            if raised and torch.is_grad_enabled():  # see [Note: an exception inside forward]
                self.unit_sources.failure.fail(f"a training forward pass raised on {ranks_named(raised)} only")

    def forward_raised(self) -> list[int]:
        """An exception left the model's forward: free what it gathered (what an earlier
        forward's backward or an external use needs is gathered again or held), and end the
        forward with the others (their gathers served); the ranks whose forward raised."""
        for unit in self.units:
            if unit not in self.external.held:
                self.free(unit)
        self.open_pass.clear()
        self.root_module_passes = []
        self.root_opened_by = None
        self.external.calls_open = 0
        self.external.forward_done()
        return self.order.forward_done(raised=True)

    # ------------------------------------------------------------------ forwards without grad, units held

    @contextlib.contextmanager
    def holding(self, budget: int):
        """Inside: a unit that a forward without grad gathered stays gathered while the held units
        fit ``budget`` bytes (decoding gathers each unit once per ``generate()``, not once per token);
        every held unit is freed on exit. See [Note: generation at stage 3] in stages/forward.py."""
        if self.hold_budget is not None:  # nested: the outer context decides
            yield
            return
        self.hold_budget = budget
        try:
            yield
        finally:
            self.hold_budget = None
            held, self.held = self.held, set()
            for unit in held:
                self.free(unit)

    def _hold(self, unit: Unit) -> bool:
        if self.hold_budget is None or torch.is_grad_enabled():
            return False
        if unit not in self.held:
            size = sum(b.param_nbytes for b in unit.buckets)
            if sum(b.param_nbytes for u in self.held for b in u.buckets) + size > self.hold_budget:
                return False
            self.held.add(unit)
        return True

    def pre_backward(self, unit: Unit, *passes) -> None:
        self.unit_sources.backward.begin_backward()
        if unit.has_frozen:
            for unit_pass in passes or (None,):
                self.unit_backward.on_output_grad(unit, unit_pass)
        self.gather(unit)
        self._prefetch_after(unit, self._backward_order())

    # ------------------------------------------------------------------ what backward reduces: units

    def reduction_order(self) -> list:
        seen = self.forward_order[::-1]
        return self.order.reduction_order(seen + [u for u in self.units[::-1] if u not in seen], self.units)

    def item_of(self, bucket: FlatBucket) -> Unit:
        return self.unit_of[bucket]

    def expected_grads(self, unit: Unit) -> int:
        return unit.grad_param_count

    def launch(self, unit: Unit) -> list[Work]:
        launch = self.sources.grads.launch
        return [work for bucket in unit.grad_buckets
                for work in self.order.reduce(bucket, lambda bucket=bucket: launch(bucket))]

    def after_arrival(self, unit: Unit) -> None:
        if not self.unit_backward.busy(unit):
            self.release_unit(unit)

    def release_unit(self, unit: Unit) -> None:
        """Free a unit whose backward is over: every gradient has arrived and no backward still
        runs through it (unit_backward.py: [Note: a unit's backward ends with its input gradients])."""
        unit_sources = self.unit_sources
        if unit in self.external.held:
            return  # an external use's backward may still read it: freed when backward ends
        if unit_sources.step_state.in_backward and unit_sources.arrivals(unit) == unit.grad_param_count:
            self.free(unit)

    def begin_backward(self) -> None:
        self.unit_backward.begin()

    def end_backward(self) -> None:
        for unit in self.units:
            self.free(unit)
        self.external.held.clear()
        if self.unit_sources.disk_params is not None:
            self.unit_sources.disk_params.drop_unused_reads()
        self.unit_backward.end()
        self.last_forward_order, self.forward_order = self.forward_order, []

    def param_bytes(self) -> int:
        return sum(nbytes(b.kept_shard) for b in self.sources.buckets() if b.kept_shard is not None)
