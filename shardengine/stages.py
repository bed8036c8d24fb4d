"""The four ZeRO stages, each a small delta over the one before.

``DataParallel``            stage 0: replicas; gradient buckets all-reduced.
``ShardedOptimizerStates``  stage 1: + reduce-scatter to owned slices; the
                            optimizer steps only those; all-gather params after.
``ShardedGradients``        stage 2: + full gradients exist only per bucket, in
                            flight; each rank keeps its reduced slice.
``ShardedParameters``       stage 3 (stage3.py): + parameters kept as slices,
                            gathered per unit around its forward and backward.

Every stage hooks the end of each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``) and hands ready items to an
:class:`~shardengine.reducer.OrderedReducer`, so communication overlaps the
rest of backward; the last items are flushed when backward ends.

[Note: gradient windows]
Reduced gradients accumulate in each bucket's ``grad_shard`` over the
micro-steps of one window; the optimizer step (or ``zero_grad``) ends the
window. With fp16 they stay multiplied by the loss scale until the window's
first ``clip_grad_norm_`` or step unscales them once, so accumulating several
reductions stays linear.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import nn

from .comm import Communicator, Work
from .config import ConfigError, ShardConfig
from .flat_bucket import FlatBucket
from .memory import LiveBytes, MemoryReport, nbytes
from .plan import plan_replicated_buckets
from .optim import check_shardable, optimizer_state_bytes, rebuild_over
from .precision import DynamicLossScaler, cast_floats
from .reducer import OrderedReducer
from .units import tensors_in


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
        self.scaler = _make_scaler(config)
        self._name_of = {id(p): name for name, p in module.named_parameters()}
        self._backward_started = False
        self._window_normalized = False
        self._found_inf = False
        self._used: set[int] = set()       # ids of params that got a gradient this window
        self._unused: set[int] = set()     # ... and of those that got none on any rank
        self._held_back: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []
        self.buckets = self._make_buckets(group_of)
        self._slot_of = {id(param): (bucket, index) for bucket in self.buckets
                         for index, param in enumerate(bucket.params)}
        self.reducer = OrderedReducer(self._launch_reduction, self._expected_grads,
                                      self._max_inflight())
        self._broadcast_rest()
        self._prepare_grads()
        self._register_hooks()

    # ------------------------------------------------------------------ policy

    @property
    def separate_master(self) -> bool:
        return self.config.mixed_precision or self.config.offload_optimizer

    @property
    def rebuilds_optimizer(self) -> bool:
        """Stage 0 keeps the user's optimizer unless fp32 masters are needed."""
        return self.stage >= 1 or self.separate_master

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        return self.config.reduce_dtype or self.config.param_dtype

    def _adopts_grads(self, bucket: FlatBucket) -> bool:
        """``param.grad`` can be a view into the bucket (same dtype, persistent buffer)."""
        return self.stage <= 1 and bucket.grad_dtype == bucket.dtype

    def _max_inflight(self) -> Optional[int]:
        return None  # stages 0-1 keep gradients anyway: no buffer to bound

    # ------------------------------------------------------------------ wrap time

    def _make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        device = device_of(self.module)
        buckets = []
        for plan in plan_replicated_buckets(self.module, group_of, self.config.bucket_bytes):
            bucket = self._new_bucket(plan.params, plan.group_index, device)
            self._finish_bucket(bucket)
            buckets.append(bucket)
        return buckets

    def _new_bucket(self, params: list[nn.Parameter], group_index, device) -> FlatBucket:
        return FlatBucket(params, group_index, self.comm.rank, self.world, device,
                          steps_whole=self.stage == 0)

    def _finish_bucket(self, bucket: FlatBucket) -> None:
        """Sync from rank 0, split off the fp32 master, cast to the compute dtype."""
        self.comm.broadcast(bucket.full_param)  # all ranks start from rank 0's weights
        if self.rebuilds_optimizer and bucket.requires_grad:
            offload = torch.device("cpu") if self.config.offload_optimizer else None
            bucket.make_master(separate=self.separate_master, device=offload)
        bucket.cast_params(self.config.param_dtype)
        bucket.grad_dtype = self.grad_dtype or bucket.dtype

    def _broadcast_rest(self) -> None:
        """Frozen parameters (cast to the compute dtype) and buffers, from rank 0."""
        bucketed = {id(p) for b in self.buckets for p in b.params}
        for param in self.module.parameters():
            if id(param) not in bucketed and param.numel() > 0:
                self.comm.broadcast(param.data)
                if self.config.param_dtype is not None and param.is_floating_point():
                    param.data = param.data.to(self.config.param_dtype)
        for buffer in self.module.buffers():
            if buffer.numel() > 0:
                self.comm.broadcast(buffer)

    def _prepare_grads(self) -> None:
        for bucket in self.buckets:  # persistent; param.grad may be views into it
            bucket.alloc_full_grad()

    def _register_hooks(self) -> None:
        self._handles = [p.register_post_accumulate_grad_hook(self._on_param_grad)
                         for b in self.buckets if b.requires_grad for p in b.params]
        self._handles.append(self.module.register_forward_hook(self._root_post_forward))
        if self.config.param_dtype is not None:
            self._handles.append(self.module.register_forward_pre_hook(
                self._cast_inputs, with_kwargs=True))

    def _cast_inputs(self, module, args, kwargs):
        dtype = self.config.param_dtype
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)

    # ------------------------------------------------------------------ backward

    def _root_post_forward(self, module, args, output):
        # Starts the backward bookkeeping (and the final flush) even if no parameter
        # gets a gradient, and applies the fp16 loss scale (see precision.py).
        if torch.is_grad_enabled():
            for tensor in tensors_in(output):
                tensor.register_hook(self._on_output_grad)
        return output

    def _on_output_grad(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        self._begin_backward()
        return grad * self.scaler.scale if self.scaler is not None else None

    def _on_param_grad(self, param: nn.Parameter) -> None:
        bucket, index = self._slot_of[id(param)]
        self._used.add(id(param))
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
        if self._adopts_grads(bucket):
            bucket.adopt_grad(index)
        else:
            bucket.absorb_grad(index)

    def _adopt_missing(self, bucket: FlatBucket) -> None:
        if self._adopts_grads(bucket):  # parameters that got no gradient count as zero
            for index in range(len(bucket.params)):
                bucket.adopt_grad(index)

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        self._adopt_missing(bucket)
        grad = bucket.full_grad
        work = self.comm.all_reduce(grad, async_op=True)
        return [work.then(lambda: self._store_reduced(bucket, grad.div_(self.world)))]

    def _store_reduced(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        # In place: the next micro-step's local gradients add onto the average, and the
        # next all-reduce then yields the sum of averages (reduction is linear).
        self._check_window_open(bucket)
        bucket.grad_shard = reduced
        self._mark_reduced(bucket)

    def _check_window_open(self, bucket: FlatBucket) -> None:
        if self._window_normalized and not bucket.window_fresh and self._window_divisor() != 1.0:
            raise RuntimeError("a backward pass reduced gradients after clip_grad_norm_() in the "
                               "same accumulation window; call the optimizer step (or zero_grad) "
                               "before the next backward")

    def _mark_reduced(self, bucket: FlatBucket) -> None:
        bucket.window_fresh = False
        self._window_normalized = False

    def _window_divisor(self) -> float:
        """What stored gradients must still be divided by (see [Note: gradient windows])."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def finish_gradient_sync(self) -> None:
        """Wait for reductions in flight; normalize the window's gradients once; fp16: look for overflow."""
        self.reducer.wait_all()
        if self._window_normalized:
            return
        grads, divisor = self._window_grads(), self._window_divisor()
        if divisor != 1.0:
            for grad in grads:
                grad.div_(divisor)
        if self.scaler is not None:
            self._found_inf = self._any_nonfinite(grads)
        if self.config.find_unused_parameters:
            self._unused = self._globally_unused()
        self._window_normalized = True

    def _globally_unused(self) -> set[int]:
        params = [p for b in self.buckets if b.requires_grad for p in b.params]
        flags = torch.tensor([float(id(p) in self._used) for p in params],
                             device=device_of(self.module, allow_meta=True))
        self.comm.all_reduce_max(flags)
        return {id(p) for p, used in zip(params, flags.tolist()) if not used}

    def _window_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets if not b.window_fresh and b.grad_shard is not None]

    def _any_nonfinite(self, grads: list[torch.Tensor]) -> bool:
        flag = torch.zeros(1, device=device_of(self.module, allow_meta=True))
        for grad in grads:
            flag += (~torch.isfinite(grad)).any().to(flag.dtype)
        self.comm.all_reduce_max(flag)  # skip on every rank, or on none
        return bool(flag.item() > 0)

    # ------------------------------------------------------------------ optimizer

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.rebuilds_optimizer:
            check_shardable(optimizer, self.config.allow_unknown_optimizer)
            masters = [[b.master for b in self.buckets if b.group_index == index and b.master is not None]
                       for index in range(len(optimizer.param_groups))]
            optimizer = rebuild_over(optimizer, masters)
        self.optimizer = optimizer
        optimizer.register_step_pre_hook(lambda *_: self.before_step())
        optimizer.register_step_post_hook(lambda *_: self.after_step())
        optimizer.zero_grad = _also_calls(optimizer.zero_grad, self.zero_grad)
        return optimizer

    def _stepped_buckets(self) -> list[FlatBucket]:
        return [b for b in self.buckets if b.master is not None]

    def before_step(self) -> None:
        self.finish_gradient_sync()
        if not self.rebuilds_optimizer:
            for param in (p for b in self.buckets for p in b.params if id(p) in self._unused):
                param.grad = None  # torch optimizers skip a parameter with no gradient
            return
        skip = self.scaler is not None and self._found_inf
        for bucket in self._stepped_buckets():  # a None grad makes the optimizer skip it
            unused = self._unused_ranges(bucket)
            if skip or unused == "all":
                bucket.master.grad = None
                continue
            bucket.master.grad = bucket.master_grad()
            self._hold_back(bucket.master, unused)

    def _unused_ranges(self, bucket: FlatBucket):
        """Ranges of ``bucket.master`` whose parameters got no gradient on any rank ("all" if all)."""
        if not self._unused:
            return []
        if self.stage == 0:
            pieces = [(slot.offset, slot.end, id(param))
                      for slot, param in zip(bucket.layout.slots, bucket.params)]
        else:
            pieces = [(f.shard_start, f.shard_start + f.numel, id(bucket.params[f.slot]))
                      for f in bucket.layout.fragments(self.comm.rank)]
        unused = [(start, end) for start, end, pid in pieces if pid in self._unused]
        return "all" if len(unused) == len(pieces) else unused

    def _hold_back(self, master: nn.Parameter, ranges: list[tuple[int, int]]) -> None:
        """Remember the master's (and its element-wise state's) values over ``ranges``."""
        state = self.optimizer.state.get(master, {})
        tensors = [master.data] + [t for t in state.values()
                                   if torch.is_tensor(t) and t.shape == master.shape]
        self._held_back += [(t, start, end, t[start:end].clone())
                            for t in tensors for start, end in ranges]

    def _restore_held_back(self) -> None:
        for tensor, start, end, saved in self._held_back:
            tensor[start:end].copy_(saved)
        self._held_back = []

    def after_step(self) -> None:
        if not self.rebuilds_optimizer:
            return
        skipped = self.scaler is not None and self._found_inf
        self._restore_held_back()
        if not skipped:
            for bucket in self._stepped_buckets():
                bucket.copy_master_to_params()
            self._sync_params_after_step()
        if self.scaler is not None:
            self.scaler.update(skipped)
            self._found_inf = False
        self._end_grad_window()

    def _sync_params_after_step(self) -> None:
        pass  # stage 0: every rank stepped everything

    def _end_grad_window(self) -> None:
        """The step consumed the gradients; the next backward starts from zero."""
        self._used, self._unused = set(), set()
        for bucket in self.buckets:
            bucket.window_fresh = True
            if bucket.master is not None:
                bucket.master.grad = None
            if bucket.full_grad is not None and self.stage <= 1:
                if self._adopts_grads(bucket):
                    for param in bucket.params:
                        param.grad = None  # adopt_grad treats None as zero
                else:
                    bucket.full_grad.zero_()
        self._window_normalized = False

    def zero_grad(self) -> None:
        self._end_grad_window()
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None

    # ------------------------------------------------------------------ clipping

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.finish_gradient_sync()
        grads = self._window_grads()
        device = device_of(self.module, allow_meta=True)
        replicated = self.stage == 0  # every rank holds the same full gradients
        if norm_type == math.inf:
            total = torch.zeros(1, device=device)
            for grad in grads:
                total = torch.maximum(total, grad.abs().max().float().reshape(1))
            if not replicated:
                self.comm.all_reduce_max(total)
            total = total[0]
        else:
            total = torch.zeros(1, device=device)
            for grad in grads:
                total += grad.float().abs().pow(norm_type).sum()
            if not replicated:
                self.comm.all_reduce(total).wait()
            total = total[0] ** (1.0 / norm_type)
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
            for bucket in self._stepped_buckets():
                if bucket.master_is_separate:
                    bucket.master.copy_(bucket.full_param[bucket.step_range])

    # ------------------------------------------------------------------ reports

    def ring_model_bytes(self, micro_steps: int) -> int:
        """Bytes sent per optimizer step (see :meth:`ShardedModel.ring_model_bytes`)."""
        return self._gradient_bytes("all_reduce")

    def _gradient_bytes(self, collective: str) -> int:
        """What one ``collective`` over every trainable bucket's full gradient sends."""
        return sum(self.comm.bytes_sent(collective, b.grad_nbytes) for b in self.buckets if b.requires_grad)

    def _gather_bytes(self, buckets: list[FlatBucket]) -> int:
        """What all-gathering these buckets' full parameters sends."""
        return sum(self.comm.bytes_sent("all_gather", b.param_nbytes) for b in buckets)

    def memory_report(self) -> MemoryReport:
        masters = sum(nbytes(b.master) for b in self.buckets if b.master_is_separate)
        optimizer = self._optimizer_bytes() + masters
        offloaded = self.config.offload_optimizer
        return MemoryReport(
            params=self._param_bytes(), grads=self._grad_bytes(),
            optimizer_states=0 if offloaded else optimizer,
            comm_buffers=self.live.current, peak_comm_buffers=self.live.peak,
            host_optimizer_states=optimizer if offloaded else 0)

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
        owned_grad = bucket.full_grad[bucket.owned]
        # The full gradient is persistent here, so reduce into its own owned slice when the
        # communicator can do that without a buffer (Gloo's all-reduce); else via a slice-sized one.
        shard = owned_grad if self.comm.reduces_in_place else self._temp_shard(bucket)
        work = self.comm.reduce_scatter(shard, bucket.full_grad, async_op=True)
        return [work.then(lambda: self._store_reduced(bucket, shard))]

    def _temp_shard(self, bucket: FlatBucket) -> torch.Tensor:
        shard = torch.empty(bucket.layout.shard_numel, dtype=bucket.grad_dtype,
                            device=bucket.full_param.device)
        self.live.add(nbytes(shard))
        return shard

    def _store_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        # The owned slice of the persistent full gradient keeps the reduced *sum* and the
        # rest is zeroed, so a further micro-step adds local gradients on top and the next
        # reduce-scatter yields the running sum; it is divided by N once, at the step.
        self._check_window_open(bucket)
        owned_grad = bucket.full_grad[bucket.owned]
        if shard.data_ptr() != owned_grad.data_ptr():
            owned_grad.copy_(shard)
            self.live.sub(nbytes(shard))
        bucket.full_grad[:bucket.owned.start].zero_()
        bucket.full_grad[bucket.owned.stop:].zero_()
        bucket.grad_shard = owned_grad
        self._mark_reduced(bucket)

    def _window_divisor(self) -> float:
        return super()._window_divisor() * self.world

    def ring_model_bytes(self, micro_steps: int) -> int:
        reduced = self._gradient_bytes("reduce_scatter")
        return self._reductions_per_step(micro_steps) * reduced + self._gather_bytes(self._stepped_buckets())

    def _reductions_per_step(self, micro_steps: int) -> int:
        return 1  # no_sync() defers the reduction to the last micro-step

    def _sync_params_after_step(self) -> None:
        works = [self.comm.all_gather(b.full_param, b.param_shard, async_op=True)
                 for b in self._stepped_buckets()]
        for work in works:
            work.wait()


class ShardedGradients(ShardedOptimizerStates):
    """Stage 2: full gradients live only while their bucket is being reduced."""

    stage = 2

    def _max_inflight(self) -> Optional[int]:
        return self.config.max_inflight_buckets

    def _prepare_grads(self) -> None:
        for bucket in self.buckets:
            if bucket.requires_grad:
                bucket.grad_shard = torch.zeros(bucket.layout.shard_numel, dtype=bucket.grad_dtype,
                                                device=bucket.full_param.device)

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
        bucket.zero_unwritten()
        shard = self._temp_shard(bucket)
        work = self.comm.reduce_scatter(shard, bucket.full_grad, async_op=True)
        return [work.then(lambda: self._store_reduced(bucket, shard))]

    def _store_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        self._check_window_open(bucket)
        bucket.accumulate_grad_shard(shard.div_(self.world))
        self.live.sub(nbytes(shard) + nbytes(bucket.full_grad))
        bucket.free_full_grad()
        self._mark_reduced(bucket)

    def _window_divisor(self) -> float:
        return DataParallel._window_divisor(self)  # averaged as each reduction lands

    def _reductions_per_step(self, micro_steps: int) -> int:
        return micro_steps  # reduce-scattered every micro-step (see _launch_enabled)

    def _grad_bytes(self) -> int:
        return sum(nbytes(b.grad_shard) for b in self.buckets)


# ---------------------------------------------------------------------- helpers


def _make_scaler(config: ShardConfig) -> Optional[DynamicLossScaler]:
    if config.param_dtype != torch.float16:
        return None
    if config.loss_scale in (None, "dynamic"):
        return DynamicLossScaler(scale=float(config.initial_loss_scale))
    fixed = float(config.loss_scale)
    return DynamicLossScaler(scale=fixed, growth_factor=1.0, backoff_factor=1.0, min_scale=fixed)


def _also_calls(method, first):
    """``method`` that runs ``first()`` before itself (engine bookkeeping on zero_grad)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        first()
        return method(*args, **kwargs)
    return wrapper


def device_of(module: nn.Module, allow_meta: bool = False) -> torch.device:
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if len(devices) > 1:
        raise ConfigError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                          "move the model to one device first")
    if devices:
        return devices.pop()
    if any(p.is_meta for p in module.parameters()) and not allow_meta:
        raise ConfigError("the model is on the meta device; only stage 3 materializes a meta "
                          "model (shard by shard). Build it on a real device or use stage=3")
    from .comm import current_backend
    return torch.device("cuda", torch.cuda.current_device()) if current_backend() == "nccl" \
        else torch.device("cpu")
