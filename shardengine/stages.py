"""The four ZeRO stages, each a small delta over the one before.

``DataParallel``            stage 0: replicas; gradient buckets all-reduced.
``ShardedOptimizerStates``  stage 1: + reduce-scatter to owned slices; the
                            optimizer steps only those; all-gather params after.
``ShardedGradients``        stage 2: + full gradients exist only per bucket, in
                            flight; each rank keeps its reduced slice.
``ShardedParameters``       stage 3: + parameters kept as slices, gathered per
                            unit around its forward and backward.

Every stage hooks the end of each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``) and hands ready items to an
:class:`~shardengine.reducer.OrderedReducer`, so communication overlaps the
rest of backward; the last items are flushed when backward ends.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .comm import Communicator, Work
from .config import ConfigError, ShardConfig
from .flat_bucket import FlatBucket
from .layout import split_into_buckets
from .memory import LiveBytes, MemoryReport, nbytes
from .optim import check_shardable, optimizer_state_bytes, rebuild_over
from .reducer import OrderedReducer
from .units import Unit, find_units, in_backward, tensors_in


class DataParallel:
    """Stage 0: every rank holds everything; gradients are averaged with all-reduce."""

    stage = 0

    def __init__(self, module: nn.Module, comm: Communicator, config: ShardConfig,
                 group_of: dict[int, int]):
        self.module, self.comm, self.config = module, comm, config
        self.world = comm.world_size
        self.live = LiveBytes()
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.sync_enabled = True
        self._name_of = {id(p): name for name, p in module.named_parameters()}
        self._backward_started = False
        self.buckets = self._make_buckets(group_of)
        self._slot_of = {id(param): (bucket, index) for bucket in self.buckets
                         for index, param in enumerate(bucket.params)}
        self.reducer = OrderedReducer(self._launch_reduction, self._expected_grads,
                                      self._max_inflight())
        self._broadcast_rest()
        self._prepare_grads()
        self._register_hooks()

    # ------------------------------------------------------------------ wrap time

    def _max_inflight(self) -> Optional[int]:
        return None  # stages 0-1 keep gradients anyway: no buffer to bound

    def _bucketed_params(self) -> list[nn.Parameter]:
        """Trainable, non-empty parameters, in reverse registration order (≈ backward order)."""
        params = [p for p in self.module.parameters() if p.requires_grad and p.numel() > 0]
        return params[::-1]

    def _make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        device = _device_of(self.module)
        buckets = []
        for key, params in _group_by_key(self._bucketed_params(), group_of).items():
            elements = self.config.bucket_bytes // params[0].element_size()
            for indices in split_into_buckets([p.numel() for p in params], max(1, elements)):
                bucket = FlatBucket([params[i] for i in indices], key[0], self.comm.rank,
                                    self.world, device)
                self.comm.broadcast(bucket.full_param)  # all ranks start from rank 0's weights
                buckets.append(bucket)
        return buckets

    def _broadcast_rest(self) -> None:
        """Frozen parameters and buffers, from rank 0."""
        bucketed = {id(p) for b in self.buckets for p in b.params}
        for param in self.module.parameters():
            if id(param) not in bucketed and param.numel() > 0:
                self.comm.broadcast(param.data)
        for buffer in self.module.buffers():
            if buffer.numel() > 0:
                self.comm.broadcast(buffer)

    def _prepare_grads(self) -> None:
        for bucket in self.buckets:  # persistent; param.grad become views into it
            bucket.alloc_full_grad()

    def _register_hooks(self) -> None:
        self._handles = [p.register_post_accumulate_grad_hook(self._on_param_grad)
                         for b in self.buckets if b.requires_grad for p in b.params]
        self._handles.append(self.module.register_forward_hook(self._root_post_forward))

    # ------------------------------------------------------------------ backward

    def _root_post_forward(self, module, args, output):
        # Makes sure the end-of-backward flush runs even if no parameter gets a gradient.
        if torch.is_grad_enabled():
            for tensor in tensors_in(output):
                tensor.register_hook(lambda grad: self._begin_backward())
        return output

    def _on_param_grad(self, param: nn.Parameter) -> None:
        bucket, index = self._slot_of[id(param)]
        self._begin_backward()
        self._store_grad(bucket, index)
        item = self._item_of(bucket)
        self.reducer.arrived(item, self._name_of.get(id(param), "?"))
        self._after_arrival(item)
        self.reducer.launch_ready(self._launch_enabled())

    def _begin_backward(self) -> None:
        if not self._backward_started:
            self._backward_started = True
            self.reducer.start(self._reduction_order())
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._backward_started = False
        if self._launch_enabled():
            self.reducer.flush()
        self.reducer.start([])

    def _launch_enabled(self) -> bool:
        return self.sync_enabled

    def _reduction_order(self) -> list:
        return list(self.buckets)

    def _item_of(self, bucket: FlatBucket):
        return bucket

    def _expected_grads(self, bucket: FlatBucket) -> int:
        return len(bucket.params)

    def _after_arrival(self, item) -> None:
        pass

    def _store_grad(self, bucket: FlatBucket, index: int) -> None:
        bucket.adopt_grad(index)

    def _adopt_missing(self, bucket: FlatBucket) -> None:
        for index in range(len(bucket.params)):
            bucket.adopt_grad(index)

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        self._adopt_missing(bucket)  # parameters that got no gradient count as zero
        grad = bucket.full_grad
        return [self.comm.all_reduce(grad, async_op=True).then(lambda: grad.div_(self.world))]

    def finish_gradient_sync(self) -> None:
        self.reducer.wait_all()

    # ------------------------------------------------------------------ optimizer

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.optimizer = optimizer
        optimizer.register_step_pre_hook(lambda *_: self.before_step())
        optimizer.register_step_post_hook(lambda *_: self.after_step())
        return optimizer

    def before_step(self) -> None:
        self.finish_gradient_sync()

    def after_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None

    # ------------------------------------------------------------------ clipping

    def _grads_for_norm(self) -> tuple[list[torch.Tensor], bool]:
        """Gradient tensors covering the model once, and whether they are replicated."""
        return [b.full_grad for b in self.buckets], True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.finish_gradient_sync()
        grads, replicated = self._grads_for_norm()
        device = _device_of(self.module)
        if norm_type == math.inf:
            local = max((g.abs().max().float() for g in grads if g.numel()), default=torch.zeros(()))
            total = local.to(device).reshape(1).clone()
            if not replicated:
                self.comm.all_reduce_max(total)
            total = total[0]
        else:
            powered = sum((g.float().abs().pow(norm_type).sum() for g in grads), torch.zeros((), device=device))
            powered = powered.reshape(1)
            if not replicated:
                self.comm.all_reduce(powered).wait()
            total = powered[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
        return total

    # ------------------------------------------------------------------ full state

    def full_state_dict(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        keep = not rank0_only or self.comm.rank == 0
        state = self.module.state_dict(keep_vars=True)
        return {key: value.detach().clone() for key, value in state.items()} if keep else {}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.module.load_state_dict(state_dict)  # params are views: shards follow

    # ------------------------------------------------------------------ reports

    def memory_report(self) -> MemoryReport:
        return MemoryReport(
            params=self._param_bytes(), grads=self._grad_bytes(),
            optimizer_states=self._optimizer_bytes(),
            comm_buffers=self.live.current, peak_comm_buffers=self.live.peak)

    def _param_bytes(self) -> int:
        bucketed = {id(p) for b in self.buckets for p in b.params}
        loose = sum(nbytes(p) for p in self.module.parameters() if id(p) not in bucketed)
        return loose + sum(nbytes(b.full_param) for b in self.buckets)

    def _grad_bytes(self) -> int:
        return sum(nbytes(b.full_grad) for b in self.buckets)

    def _optimizer_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer) if self.optimizer is not None else 0


class ShardedOptimizerStates(DataParallel):
    """Stage 1: reduce-scatter gradients; step only the owned slice; all-gather params."""

    stage = 1

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        self._adopt_missing(bucket)
        shard = self._temp_shard(bucket)
        work = self.comm.reduce_scatter(shard, bucket.full_grad, async_op=True)
        return [work.then(lambda: self._store_reduced(bucket, shard))]

    def _temp_shard(self, bucket: FlatBucket) -> torch.Tensor:
        shard = torch.empty_like(bucket.param_shard)
        self.live.add(nbytes(shard))
        return shard

    def _store_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        # The owned slice of the persistent full gradient doubles as the shard's grad.
        owned_grad = bucket.full_grad[bucket.owned]
        owned_grad.copy_(shard).div_(self.world)
        bucket.make_master().grad = owned_grad
        self.live.sub(nbytes(shard))

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        check_shardable(optimizer, self.config.allow_unknown_optimizer)
        masters = [[b.make_master() for b in self.buckets if b.group_index == index]
                   for index in range(len(optimizer.param_groups))]
        return super().wrap_optimizer(rebuild_over(optimizer, masters))

    def after_step(self) -> None:
        works = [self.comm.all_gather(b.full_param, b.param_shard, async_op=True)
                 for b in self.buckets]
        for work in works:
            work.wait()
        super().zero_grad()  # full gradients are spent; the next backward starts afresh

    def zero_grad(self) -> None:
        super().zero_grad()
        for bucket in self.buckets:
            if bucket.master is not None:
                bucket.master.grad = None

    def _grads_for_norm(self) -> tuple[list[torch.Tensor], bool]:
        return [b.master.grad for b in self.buckets
                if b.master is not None and b.master.grad is not None], False


class ShardedGradients(ShardedOptimizerStates):
    """Stage 2: full gradients live only while their bucket is being reduced."""

    stage = 2

    def _max_inflight(self) -> Optional[int]:
        return self.config.max_inflight_buckets

    def _prepare_grads(self) -> None:
        for bucket in self.buckets:
            if bucket.requires_grad:
                bucket.grad_shard = torch.zeros_like(bucket.param_shard)

    def _launch_enabled(self) -> bool:
        # Skipping the reduction under no_sync() would mean holding a full unsharded
        # gradient across micro-steps: exactly the memory this stage exists to save.
        return True

    def _store_grad(self, bucket: FlatBucket, index: int) -> None:
        had_buffer = bucket.full_grad is not None
        bucket.absorb_grad(index)
        if not had_buffer and bucket.full_grad is not None:
            self.live.add(nbytes(bucket.full_grad))

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        if bucket.full_grad is None:  # no gradient arrived: reduce zeros, ranks must agree
            self.live.add(nbytes(bucket.alloc_full_grad()))
        shard = self._temp_shard(bucket)
        work = self.comm.reduce_scatter(shard, bucket.full_grad, async_op=True)
        return [work.then(lambda: self._store_reduced(bucket, shard))]

    def _store_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        bucket.store_reduced_shard(shard.div_(self.world))
        self.live.sub(nbytes(shard) + nbytes(bucket.full_grad))
        bucket.free_full_grad()

    def _grad_bytes(self) -> int:
        return sum(nbytes(b.grad_shard) for b in self.buckets)


class ShardedParameters(ShardedGradients):
    """Stage 3: parameters live as slices; each unit is gathered around its use."""

    stage = 3

    def _make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        _check_no_meta_buffers(self.module)
        self.units: list[Unit] = []
        for module, name, params in find_units(self.module, self.config.wrap,
                                               self.config.wrap_min_params):
            unit = Unit(module, name, self._make_unit_buckets(module, params, group_of))
            self.units.append(unit)
        self._unit_of = {bucket: unit for unit in self.units for bucket in unit.buckets}
        self._forward_order: list[Unit] = []
        return [bucket for unit in self.units for bucket in unit.buckets]

    def _make_unit_buckets(self, module: nn.Module, params: list[nn.Parameter],
                           group_of: dict[int, int]) -> list[FlatBucket]:
        """Pack, materialize, sync from rank 0, and shard one unit: peak = one unit."""
        device = self._device
        params = [p for p in params if p.numel() > 0]
        meta = any(p.is_meta for p in params)
        buckets = [FlatBucket(ps, key[0], self.comm.rank, self.world, device)
                   for key, ps in _group_by_key(params, group_of, by_grad=True).items()]
        if meta:
            _initialize_unit(module, {id(p) for p in params}, self.config.param_init_fn)
        for bucket in buckets:
            self.comm.broadcast(bucket.full_param)
            bucket.shard_params()
        return buckets

    @property
    def _device(self) -> torch.device:
        if not hasattr(self, "_device_cache"):
            self._device_cache = _device_of(self.module, allow_meta=True)
        return self._device_cache

    def _broadcast_rest(self) -> None:
        for buffer in self.module.buffers():
            if buffer.numel() > 0:
                self.comm.broadcast(buffer)

    def _register_hooks(self) -> None:
        super()._register_hooks()
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(
                lambda module, args, unit=unit: self._pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(
                lambda module, args, output, unit=unit: self._post_forward(unit, output)))

    # ------------------------------------------------------------------ gather / free

    def _gather(self, unit: Unit) -> None:
        works = [self._gather_bucket(b) for b in unit.buckets if not b.full_params_live]
        for work in works:
            work.wait()

    def _gather_bucket(self, bucket: FlatBucket) -> Work:
        bucket.alloc_full_params()
        self.live.add(nbytes(bucket.full_param))
        return self.comm.all_gather(bucket.full_param, bucket.param_shard, async_op=True)

    def _free(self, unit: Unit) -> None:
        for bucket in unit.buckets:
            if bucket.full_params_live:
                self.live.sub(nbytes(bucket.full_param))
                bucket.free_full_params()

    def _pre_forward(self, unit: Unit) -> None:
        if torch.is_grad_enabled() and unit not in self._forward_order:
            self._forward_order.append(unit)
        self._gather(unit)

    def _post_forward(self, unit: Unit, output) -> None:
        if torch.is_grad_enabled():
            for tensor in tensors_in(output):
                tensor.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        if not in_backward():  # a recompute (activation checkpointing) needs them in backward
            self._free(unit)

    def _pre_backward(self, unit: Unit) -> None:
        self._begin_backward()
        self._gather(unit)

    # ------------------------------------------------------------------ reduction

    def _reduction_order(self) -> list:
        seen = self._forward_order[::-1]
        return seen + [u for u in self.units[::-1] if u not in seen]

    def _item_of(self, bucket: FlatBucket) -> Unit:
        return self._unit_of[bucket]

    def _expected_grads(self, unit: Unit) -> int:
        return unit.grad_param_count

    def _after_arrival(self, unit: Unit) -> None:
        if self.reducer.arrivals(unit) == unit.grad_param_count:
            self._free(unit)  # its backward is done: every gradient has been accumulated

    def _launch_reduction(self, unit: Unit) -> list[Work]:
        launch = super()._launch_reduction
        return [work for bucket in unit.grad_buckets for work in launch(bucket)]

    def _end_backward(self) -> None:
        super()._end_backward()
        for unit in self.units:
            self._free(unit)
        self._forward_order = []

    def after_step(self) -> None:
        pass  # the next forward gathers the updated slices

    # ------------------------------------------------------------------ full state

    def _keys_of(self, state: dict[str, torch.Tensor]) -> dict[int, list[str]]:
        keys: dict[int, list[str]] = {}
        for key, tensor in state.items():
            keys.setdefault(id(tensor), []).append(key)
        return keys

    def full_state_dict(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        """Unit by unit, so no rank holds more than one gathered unit beyond the output."""
        keep = not rank0_only or self.comm.rank == 0
        state = self.module.state_dict(keep_vars=True)
        keys_of, full = self._keys_of(state), {}
        for unit in self.units:
            self._gather(unit)
            for param in (p for b in unit.buckets for p in b.params):
                for key in keys_of.get(id(param), []):
                    if keep:
                        full[key] = param.detach().clone()
            self._free(unit)
        if not keep:
            return {}
        return {key: full[key] if key in full else value.detach().clone()
                for key, value in state.items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        state = self.module.state_dict(keep_vars=True)
        missing = sorted(set(state) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(state))
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
        keys_of = self._keys_of(state)
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.alloc_full_params()
                for param in bucket.params:
                    param.copy_(state_dict[keys_of[id(param)][0]])
                bucket.param_shard.copy_(bucket.full_param[bucket.owned])
                bucket.free_full_params()
            for key, tensor in state.items():
                if not any(id(tensor) == id(p) for b in self.buckets for p in b.params):
                    tensor.copy_(state_dict[key])

    def _param_bytes(self) -> int:
        return sum(nbytes(b.param_shard) for b in self.buckets)


STAGE_CLASSES = {0: DataParallel, 1: ShardedOptimizerStates, 2: ShardedGradients,
                 3: ShardedParameters}


# ---------------------------------------------------------------------- helpers


def _group_by_key(params: list[nn.Parameter], group_of: dict[int, int],
                  by_grad: bool = False) -> dict[tuple, list[nn.Parameter]]:
    """Parameters that may share a flat buffer: same param group, dtype (and requires_grad)."""
    grouped: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        key = (group_of.get(id(param)), param.dtype, param.requires_grad if by_grad else True)
        grouped.setdefault(key, []).append(param)
    return grouped


def _device_of(module: nn.Module, allow_meta: bool = False) -> torch.device:
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if len(devices) > 1:
        raise ConfigError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                          "move the model to one device first")
    if devices:
        return devices.pop()
    if any(p.is_meta for p in module.parameters()) and not allow_meta:
        raise ConfigError("the model is on the meta device; only stage 3 materializes a meta "
                          "model (shard by shard). Build it on a real device or use stage=3")
    return torch.device("cuda", torch.cuda.current_device()) if _cuda_backend() else torch.device("cpu")


def _cuda_backend() -> bool:
    from .comm import current_backend
    return current_backend() == "nccl"


def _initialize_unit(unit_module: nn.Module, unit_params: set[int], init_fn) -> None:
    """Fill a unit's freshly materialized parameters (they were on the meta device)."""
    for name, module in unit_module.named_modules():
        direct = [p for p in module.parameters(recurse=False) if id(p) in unit_params]
        if not direct:
            continue
        if init_fn is not None:
            init_fn(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        else:
            raise ConfigError(f"module {name or type(unit_module).__name__} "
                              f"({type(module).__name__}) has meta-device parameters but no "
                              "reset_parameters(); pass param_init_fn= to initialize them")


def _check_no_meta_buffers(module: nn.Module) -> None:
    for name, buffer in module.named_buffers():
        if buffer.is_meta:
            raise ConfigError(f"buffer {name} is on the meta device: stage 3 materializes "
                              "parameters only. Create buffers on a real device (or register "
                              "them after shard())")
