"""Stage 3: parameters live as slices; each unit is gathered around its use.

The delta over stage 2: every unit's buckets keep only this rank's slice
(``param_shard``); a forward pre-hook all-gathers the unit, a forward hook frees
it again and hooks the unit's outputs so that backward gathers it once more;
when every gradient of the unit has arrived it is freed and its gradients are
reduce-scattered. With ``prefetch`` the next units' all-gathers are issued
while the current one computes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..distributed.work import Work
from ..flat.bucket import FlatBucket
from ..config import ShardConfig
from ..distributed.hybrid import GroupBytes, HybridCommunicator
from ..memory import nbytes
from ..flat.meta_init import MetaInit, check_meta_model
from ..flat.plan import BucketPlan, plan_unit_buckets
from .stage2 import ShardedGradients
from . import replan
from .compile_support import eager_hook
from .devices import device_of
from .unit_backward import UnitBackwardTracker
from ..flat.units import Unit, in_backward, root_entry_modules as _root_entry_modules, tensors_in


class ShardedParameters(ShardedGradients):
    """Stage 3: parameters live as slices; each unit is gathered around its use."""

    stage = 3
    forward_communicates = True    # every forward gathers units, with or without grad

    def __init__(self, module: nn.Module, comm: HybridCommunicator, config: ShardConfig,
                 group_of: dict[int, int], whole_tensor_groups: frozenset[int] = frozenset()):
        # Set before the base's __init__, whose _make_buckets / _register_hooks fill and use them.
        self.units: list[Unit] = []
        self._unit_of: dict[FlatBucket, Unit] = {}
        self._forward_order: list[Unit] = []         # units in this forward's order
        self._last_forward_order: list[Unit] = []    # ... and the last one's (prefetch follows it)
        self._pending_gathers: dict[Unit, list[Work]] = {}
        self._root_opened_by: Optional[nn.Module] = None  # a submodule called directly, see below
        self._unit_backward = UnitBackwardTracker(self._release_unit)
        self._open_pass: dict[Unit, object] = {}  # the running forward's pass, per unit
        super().__init__(module, comm, config, group_of, whole_tensor_groups)

    def _make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        _check_no_meta_buffers(self.module)
        for module, name, plans in plan_unit_buckets(self.module, group_of, self.config.wrap,
                                                     self.config.wrap_min_params):
            self.units.append(Unit(module, name, self._make_unit_buckets(module, plans)))
        self._unit_of = {bucket: unit for unit in self.units for bucket in unit.buckets}
        return [bucket for unit in self.units for bucket in unit.buckets]

    def _grow_plan(self, newly: list[nn.Parameter], group_of: dict[int, int]) -> list[FlatBucket]:
        """A frozen parameter already lives, sharded, in its unit's frozen bucket: that bucket
        trains from now on (stages/replan.py)."""
        return replan.unfreeze_unit_buckets(self, newly)

    def _make_unit_buckets(self, module: nn.Module, plans: list[BucketPlan]) -> list[FlatBucket]:
        """Pack, materialize, sync from rank 0, and shard one unit: peak = one unit."""
        device = device_of(self.module, allow_meta=True)
        meta_params = {id(p) for plan in plans for p in plan.params if p.is_meta}
        if not self.units:  # before the first unit is allocated: fail fast
            self._meta_init = MetaInit(self.module, self.config.param_init_fn)
        buckets = [self._new_bucket(plan.params, plan.group_index, device) for plan in plans]
        self._meta_init.initialize_unit(module, meta_params, device)
        for bucket in buckets:
            self._finish_bucket(bucket)
            bucket.shard_params()
        return buckets

    def _broadcast_rest(self) -> None:
        for buffer in self.module.buffers():
            if buffer.numel() > 0:
                self.comm.broadcast(buffer)

    def _register_hooks(self) -> None:
        super()._register_hooks()
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(eager_hook(
                lambda module, args, kwargs, unit=unit:
                    self._pre_forward(unit, args, kwargs) if module is unit.module else None),
                with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(eager_hook(
                lambda module, args, output, unit=unit:
                    self._post_forward(unit, output) if module is unit.module else None)))
        for module in _root_entry_modules(self.module, self.units):
            self._handles.append(module.register_forward_pre_hook(eager_hook(
                lambda module, args, owner=module: self._open_root_for(module, owner))))
            self._handles.append(module.register_forward_hook(eager_hook(
                lambda module, args, output, owner=module: self._close_root_for(module, owner, output))))

    # ------------------------------------------------------------------ submodules called directly

    def _open_root_for(self, module: nn.Module, owner: nn.Module) -> None:
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
        if module is not owner or self._root_opened_by is not None or self.step_state.forward_depth:
            return
        if all(b.full_params_live for b in root.buckets):
            return
        self._root_opened_by = owner
        self._pre_forward(root)

    def _close_root_for(self, module: nn.Module, owner: nn.Module, output) -> None:
        if module is owner and self._root_opened_by is owner:
            self._root_opened_by = None
            self._post_forward(self.units[-1], output)

    # ------------------------------------------------------------------ gather / free

    def _gather(self, unit: Unit) -> None:
        works = self._pending_gathers.pop(unit, None)
        if works is None:
            works = [self._gather_bucket(b) for b in unit.buckets if not b.full_params_live]
        for work in works:
            work.wait()

    def _prefetch(self, units: list[Unit]) -> None:
        for unit in units:
            if unit not in self._pending_gathers:
                works = [self._gather_bucket(b) for b in unit.buckets if not b.full_params_live]
                if works:
                    self._pending_gathers[unit] = works

    def _gather_bucket(self, bucket: FlatBucket) -> Work:
        bucket.alloc_full_params()
        self.live.add(nbytes(bucket.full_param))
        if self._compresses_params:
            return self.compression.all_gather_params(bucket)
        return self.comm.all_gather(bucket.full_param, bucket.param_shard, async_op=True)

    def _free(self, unit: Unit) -> None:
        for work in self._pending_gathers.pop(unit, []):
            work.wait()  # never free storage a collective is still writing
        for bucket in unit.buckets:
            if bucket.full_params_live:
                self.live.sub(nbytes(bucket.full_param))
                bucket.free_full_params()

    def _next_units(self, unit: Unit, order: list[Unit]) -> list[Unit]:
        if unit not in order:
            return []
        start = order.index(unit) + 1
        return order[start:start + self.config.prefetch]

    def _backward_order(self) -> list[Unit]:
        # The root's output gradient arrives first, then the blocks in reverse.
        order = self._forward_order
        return order[:1] + order[1:][::-1]

    def _pre_forward(self, unit: Unit, args=(), kwargs=None) -> None:
        self.check_usable()
        if torch.is_grad_enabled() and unit not in self._forward_order:
            self._forward_order.append(unit)
        if unit.has_frozen:  # see [Note: a unit's backward ends with its input gradients]
            self._open_pass[unit] = self._unit_backward.on_forward(unit, args, kwargs or {})
        self._gather(unit)
        if not in_backward():
            self._prefetch(self._next_units(unit, self._last_forward_order))

    def _post_forward(self, unit: Unit, output) -> None:
        unit_pass = self._open_pass.pop(unit, None)
        if torch.is_grad_enabled():
            for tensor in tensors_in(output):
                tensor.register_hook(lambda grad, unit=unit, unit_pass=unit_pass: self._pre_backward(unit, unit_pass))
        recomputing = in_backward()  # activation checkpointing: backward needs them now
        if not recomputing and (self.config.reshard_after_forward or not torch.is_grad_enabled()):
            self._free(unit)

    def _pre_backward(self, unit: Unit, unit_pass=None) -> None:
        self._begin_backward()
        if unit.has_frozen:
            self._unit_backward.on_output_grad(unit, unit_pass)
        self._gather(unit)
        self._prefetch(self._next_units(unit, self._backward_order()))

    # ------------------------------------------------------------------ reduction

    def _reduction_order(self) -> list:
        seen = self._forward_order[::-1]
        return seen + [u for u in self.units[::-1] if u not in seen]

    def _item_of(self, bucket: FlatBucket) -> Unit:
        return self._unit_of[bucket]

    def _expected_grads(self, unit: Unit) -> int:
        return unit.grad_param_count

    def _after_arrival(self, unit: Unit) -> None:
        if not self._unit_backward.busy(unit):
            self._release_unit(unit)

    def _release_unit(self, unit: Unit) -> None:
        """Free a unit whose backward is over: every gradient has arrived and no backward still
        runs through it (unit_backward.py: [Note: a unit's backward ends with its input gradients])."""
        if self.step_state.in_backward and self.reducer.arrivals(unit) == unit.grad_param_count:
            self._free(unit)

    def _begin_backward(self) -> None:
        starting = not self.step_state.in_backward
        super()._begin_backward()
        if starting:
            self._unit_backward.begin()

    def _launch_reduction(self, unit: Unit) -> list[Work]:
        launch = super()._launch_reduction
        return [work for bucket in unit.grad_buckets for work in launch(bucket)]

    def _end_backward(self) -> None:
        super()._end_backward()
        for unit in self.units:
            self._free(unit)
        self._unit_backward.end()
        self._last_forward_order, self._forward_order = self._forward_order, []

    def _sync_params_after_step(self) -> None:
        pass  # the next forward gathers the updated slices

    def ring_model_bytes(self, micro_steps: int) -> GroupBytes:
        gathers = 2 if self.config.reshard_after_forward else 1  # forward, and again for backward
        return (micro_steps * (self._gradient_bytes("reduce_scatter") + gathers * self._gather_bytes(self.buckets))
                + self.control_bytes(micro_steps))

    @property
    def _compresses_params(self) -> bool:
        return self.compression is not None and self.compression.params is not None

    def _gather_bytes(self, buckets: list[FlatBucket]) -> GroupBytes:
        if self._compresses_params:
            return self.compression.gather_bytes(buckets)
        return super()._gather_bytes(buckets)

    def _param_bytes(self) -> int:
        return sum(nbytes(b.param_shard) for b in self.buckets)


def _check_no_meta_buffers(module: nn.Module) -> None:
    """Meta buffers are materialized with their unit now; what remains to refuse up front."""
    check_meta_model(module)
