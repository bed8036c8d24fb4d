"""The four ZeRO stages, each a small delta over the one before.

``DataParallel``            stage 0: replicas; gradient buckets all-reduced.
``ShardedOptimizerStates``  stage 1 (stages/stage1.py): + reduce-scatter to owned slices;
                            the optimizer steps only those; all-gather params after.
``ShardedGradients``        stage 2 (stages/stage2.py): + full gradients exist only per
                            bucket, in flight; each rank keeps its reduced slice.
``ShardedParameters``       stage 3 (stages/stage3.py): + parameters kept as slices,
                            gathered per unit around its forward and backward.

Every stage hooks the end of each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``) and hands ready items to an
:class:`~shardengine.step.reducer.OrderedReducer`, so communication overlaps the
rest of backward; the last items are flushed when backward ends.

[Note: gradient windows]
Reduced gradients accumulate in each bucket's ``grad_shard`` over the
micro-steps of one window; the optimizer step (or ``zero_grad``) ends the
window. With fp16 they stay multiplied by the loss scale until the window's
first ``clip_grad_norm_`` or step unscales them once, so accumulating several
reductions stays linear. The window ends with one small all-reduce shared by
every rank (see step/agreement.py): which parameters got a gradient anywhere, fp16
overflow, and a check that the ranks are in step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..flat import guard
from ..step import join
from ..errors import CollectiveError, ConfigError
from ..distributed.launch import current_backend
from ..distributed.work import Work
from ..distributed.compression.collectives import CompressedCollectives
from ..config import ShardConfig
from ..flat.bucket import FlatBucket
from ..flat.storage import StoragePlan
from ..distributed.hybrid import HybridCommunicator
from ..memory import LiveBytes
from ..optim.rebuild import check_shardable, rebuild_over
from ..flat.plan import plan_replicated_buckets
from ..step.mixed_precision import DynamicLossScaler, cast_floats, outputs_to_scale
from ..step.reducer import OrderedReducer
from .reports import StageReports
from ..optim.sharded_optimizer import attach_optimizer
from ..step.agreement import Announcement, Contribution, ProgressCounters, exchange
from ..step.phase import Phase, StepState
from ..step.batch_weights import BatchWeights
from ..flat.units import in_backward, tensors_in


class DataParallel(StageReports):
    """Stage 0: every rank holds everything; gradients are averaged with all-reduce."""

    stage = 0

    def __init__(self, module: nn.Module, comm: HybridCommunicator, config: ShardConfig,
                 group_of: dict[int, int]):
        self.module, self.comm, self.config = module, comm, config
        self.storage = StoragePlan.from_config(config)  # which tier holds what (flat/storage.py)
        self.world = comm.world_size
        self.live = LiveBytes()
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.sync_enabled = True
        self.scaler = _make_scaler(config)
        self.counters = ProgressCounters()
        self.weights = BatchWeights()
        self.step_state = StepState()      # the step's phase (step/phase.py)
        self.join_state = join.JoinState(self.step_state)
        self._factor = 1.0                 # the running micro-step's batch-weight factor
        self._name_of = {id(p): name for name, p in module.named_parameters()}
        self._applied_divisor = 1.0        # what the window's gradients were divided by
        self._found_inf = False            # fp16: the window's agreement saw an overflow
        self._unused: set[int] = set()     # ids of params that got no gradient on any rank
        self.original_groups: list[list[nn.Parameter]] = []  # the user's param groups
        if self.stage >= 1:
            for name, param in module.named_parameters():
                guard.attach(param, name, self.stage)
        self.buckets = self._make_buckets(group_of)
        self._index_params()
        self.compression = CompressedCollectives.create(self)  # None: exact collectives
        self.reducer = OrderedReducer(self._launch_reduction, self._expected_grads,
                                      self._max_inflight())
        self._broadcast_rest()
        self._buffers = [b for b in module.buffers() if b.numel() > 0]
        self._prepare_grads()
        self._register_hooks()

    def __deepcopy__(self, memo: dict) -> "DataParallel":
        # copy.deepcopy(model.module) reaches the engine through its hooks (bound methods):
        # the copy shares the engine, whose hooks ignore any module but the one it wraps.
        return self

    # ------------------------------------------------------------------ the Engine view

    def param_name(self, param: nn.Parameter) -> str:
        """The parameter's name in the wrapped module ("?" for one it does not know)."""
        return self._name_of.get(id(param), "?")

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        """The parameters reduced and stepped (trainable at ``shard()``), in bucket order."""
        return self._trainable

    @property
    def hook_ids(self) -> set[int]:
        """Ids of the hooks this engine registered (deepcopy drops them from copies)."""
        return {handle.id for handle in self._handles}

    @property
    def phase(self) -> Phase:
        """Where this rank's step is (see [Note: the step's phases] in step/phase.py)."""
        return self.step_state.phase

    @property
    def summoned(self) -> bool:
        """Inside ``summon_full_params()`` (state/full_state.py sets it)."""
        return self.step_state.summoned

    @summoned.setter
    def summoned(self, inside: bool) -> None:
        self.step_state.summoned = inside

    # ------------------------------------------------------------------ policy

    @property
    def separate_master(self) -> bool:
        return self.config.mixed_precision or self.storage.separate_master

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

    @property
    def _compresses_grads(self) -> bool:
        return self.compression is not None and self.compression.grads is not None

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
        # Laid out over the shard group (all ranks unless hybrid, see distributed/hybrid.py).
        return FlatBucket(params, group_index, self.comm.shard.rank, self.comm.group_size, device,
                          steps_whole=self.stage == 0)

    def _finish_bucket(self, bucket: FlatBucket) -> None:
        """Sync from rank 0, split off the fp32 master, cast to the compute dtype."""
        self.comm.broadcast(bucket.full_param)  # all ranks start from rank 0's weights
        if self.rebuilds_optimizer and bucket.requires_grad:
            bucket.make_master(separate=self.separate_master, device=self.storage.master_device)
        bucket.cast_params(self.config.param_dtype)
        bucket.grad_dtype = self.grad_dtype or bucket.dtype

    def _index_params(self) -> None:
        """Lookups used on every gradient, and the set trained at wrap time."""
        self._trainable = [p for b in self.buckets if b.requires_grad for p in b.params]
        self._slot_of = {id(param): (bucket, index) for bucket in self.buckets
                         for index, param in enumerate(bucket.params)}
        self._flag_of = {id(p): index for index, p in enumerate(self._trainable)}
        self._used_flags = bytearray(len(self._trainable))
        self._frozen_at_wrap = [p for p in self.module.parameters()
                                if id(p) not in self._flag_of and p.numel() > 0]
        self._bucket_ptrs = [(b, b.params[0]) for b in self.buckets]
        self.note_params_written()

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
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(self._root_post_forward))

    # ------------------------------------------------------------------ forward

    def _root_pre_forward(self, module, args, kwargs):
        if module is not self.module:
            return None  # a copy of the module (deepcopy keeps hooks): not ours
        self.check_usable()
        if self.step_state.forward_depth and not in_backward():
            self.fail(f"a forward pass on rank {self.comm.rank} raised before finishing")
        self._check_params_still_ours()
        if not in_backward() and (torch.is_grad_enabled() or self.stage == 3):
            join.announce(self, Announcement.FORWARD, flag=torch.is_grad_enabled(), template=(args, kwargs))
        if torch.is_grad_enabled() and not in_backward():
            join.note_inputs(self, args, kwargs)
            self.counters.forwards += 1
            self.weights.infer(args, kwargs)
            if self.weights.needs_reference:
                self.agree_first_reference()
        self.step_state.forward_depth += 1
        if self.config.param_dtype is not None:
            dtype = self.config.param_dtype
            return cast_floats(args, dtype), cast_floats(kwargs, dtype)
        return None

    def sync_device(self) -> torch.device:
        """Where the engine's small control collectives live (the model's device)."""
        return device_of(self.module, allow_meta=True)

    def agree_first_reference(self) -> None:
        # Once per engine, at the first training forward, which every rank runs (a rank with
        # no data at all joins through model.join(), which takes part here too).
        numerator = torch.tensor([self.weights.coming_numerator()], dtype=torch.float64,
                                 device=self.sync_device())
        if self.comm.world_size > 1:
            self.comm.all_reduce(numerator, label="batch_weights").wait()
        self.weights.set_first_reference(float(numerator) / self.comm.world_size)

    def _root_post_forward(self, module, args, output):
        if module is not self.module:
            return output
        self.step_state.forward_depth -= 1
        if torch.is_grad_enabled():
            self.hook_outputs(output)
        return output

    def hook_outputs(self, output) -> None:
        # Starts the backward bookkeeping (and the final flush) even if no parameter
        # gets a gradient, and applies the fp16 loss scale (see step/mixed_precision.py).
        tensors = list(tensors_in(output))
        join.note_outputs(self, tensors)
        scaled = outputs_to_scale(tensors) if self.scaler is not None else []
        for tensor in tensors:
            tensor.register_hook(self._scaling_hook if id(tensor) in scaled else self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._begin_backward()

    def _scaling_hook(self, grad: torch.Tensor) -> torch.Tensor:
        self._begin_backward()
        return grad * self.scaler.scale

    def _check_params_still_ours(self) -> None:
        """Catch ``model.module.to(dtype)`` / ``.half()`` and the like after ``shard()``."""
        if self.summoned:
            raise RuntimeError("forward inside summon_full_params() is not supported: the "
                               "parameters hold summoned copies there; leave the context first")
        for bucket, first in self._bucket_ptrs:
            if bucket.full_params_live and first.data_ptr() != bucket.full_param.data_ptr():
                raise ConfigError(
                    f"the model's parameters were cast or moved after shard() ({self._name_of[id(first)]} "
                    f"is now {first.dtype} on {first.device}, the engine holds {bucket.dtype} on "
                    f"{bucket.full_param.device}). Cast or move the model before shard(); for "
                    "mixed precision pass param_dtype=.")

    # ------------------------------------------------------------------ backward

    def _on_param_grad(self, param: nn.Parameter) -> None:
        bucket, index = self._slot_of[id(param)]
        self._used_flags[self._flag_of[id(param)]] = 1
        self._begin_backward()
        with guard.engine_access():
            self._store_grad(bucket, index)
        item = self._item_of(bucket)
        self.reducer.arrived(item, self._name_of.get(id(param), "?"))
        self._after_arrival(item)
        self.reducer.launch_ready(self._launch_enabled())

    def _begin_backward(self) -> None:
        if not self.step_state.in_backward:
            self.check_usable()
            join.announce(self, Announcement.BACKWARD, flag=self._launch_enabled(),
                          aux=(float(all(b.window_fresh for b in self.buckets)), 0.0))
            self._reopen_window()
            self.step_state.move(Phase.BACKWARD)
            self._factor = self.weights.begin_backward().factor
            for bucket in self.buckets:
                if bucket.requires_grad and self._adopts_grads(bucket):
                    bucket.prepare_local_factor(self._factor)
            guard.set_grad_sharded(self._trainable, False)
            self.reducer.start(self._reduction_order())
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.step_state.move(Phase.ACCUMULATED)
        self.counters.backwards += 1
        reduced = self._launch_enabled()
        if reduced:
            self.reducer.flush()
        self.reducer.start([])
        for bucket in self.buckets:
            bucket.undo_zero_weight()  # a factor-0 micro-step under no_sync leaves nothing behind
        self.weights.end_backward()
        join.backward_done(self)
        if reduced and self.stage == 0:
            # DDP's contract: after a synchronizing backward p.grad *is* the average, so the
            # window's agreement (weights, fp16 unscaling, unused parameters) happens now.
            self.finish_gradient_sync()
        self._broadcast_buffers()
        if self.stage >= 1 and any(not b.window_fresh for b in self.buckets):
            guard.set_grad_sharded(self._trainable, True)  # see flat/guard.py: p.grad is partial now

    def _broadcast_buffers(self) -> None:
        """DDP's semantics: every forward starts from rank 0's buffers (BatchNorm statistics).

        Sent when backward ends rather than before the next forward: autograd may still
        hold a buffer for backward (BatchNorm keeps its running statistics), and the
        next forward, or an evaluation on rank 0 alone, then needs no collective.
        """
        if self.config.broadcast_buffers and self._buffers:
            self.comm.broadcast_coalesced(self._buffers, label="buffers")

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
            bucket.adopt_grad(index)  # its weight factor is applied before the reduction
        else:
            bucket.absorb_grad(index, self._factor)

    def _adopt_missing(self, bucket: FlatBucket) -> None:
        """Before an adopted bucket's reduction: absent gradients count as zero, and the
        micro-steps' weights are multiplied in (see flat/bucket.py)."""
        if self._adopts_grads(bucket):
            with guard.engine_access():
                bucket.undo_zero_weight()
                for index in range(len(bucket.params)):
                    bucket.adopt_grad(index)
                bucket.apply_local_factor()

    def _launch_reduction(self, bucket: FlatBucket) -> list[Work]:
        self._adopt_missing(bucket)
        grad = bucket.full_grad
        work = self.compression.all_reduce(bucket) if self._compresses_grads else \
            self.comm.all_reduce(grad, async_op=True)
        return [work.then(lambda: self._store_reduced(bucket, grad.div_(self.world)))]

    def _store_reduced(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        # In place: the next micro-step's local gradients add onto the average, and the
        # next all-reduce then yields the sum of averages (reduction is linear).
        bucket.grad_shard = reduced
        self._mark_reduced(bucket)

    def _reopen_window(self) -> None:
        """A backward in a window already normalized (stage 0 after a synchronizing backward,
        or after the step's agreement): take the division back, so accumulation stays linear."""
        if not self.step_state.normalized or all(b.window_fresh for b in self.buckets):
            return
        if self.step_state.window is Phase.CLIPPED:
            raise RuntimeError("a backward pass after clip_grad_norm_() in the same accumulation "
                               "window; call the optimizer step (or zero_grad) before the next backward")
        if self._applied_divisor != 1.0:
            for grad in self._window_grads():
                grad.mul_(self._applied_divisor)
        self._applied_divisor = 1.0

    def _mark_reduced(self, bucket: FlatBucket) -> None:
        bucket.window_fresh = False

    def _window_divisor(self) -> float:
        """What stored gradients must still be divided by (see [Note: gradient windows])."""
        return self.scaler.scale if self.scaler is not None else 1.0

    # ------------------------------------------------------------------ window end

    def finish_gradient_sync(self) -> None:
        """Wait for reductions in flight, agree with the other ranks (step/agreement.py) and
        normalize the window's gradients once."""
        self.check_usable()
        if self.step_state.in_backward:
            raise RuntimeError("the optimizer step (or clip_grad_norm_) was called during backward")
        self.reducer.wait_all()
        if self.step_state.normalized:
            return
        self._check_trainable_set()
        self._check_no_stray_writes()
        grads = self._window_grads()
        overflow = self.scaler is not None and _any_nonfinite(grads)
        mine = Contribution(self.counters, self._used_flags, Announcement.SYNC, active=not self.join_state.serving,
                            overflow=overflow, weight=self.weights.window_weight,
                            micro_steps=self.weights.window_micro_steps,
                            hyper_digest=join.hyperparameter_digest(self.optimizer))
        self._apply_agreement(exchange(self.comm, mine, self.sync_device()), grads)

    def _apply_agreement(self, agreement, grads: list[torch.Tensor]) -> None:
        """What every rank concluded together: overflow, unused parameters, the divisor."""
        self._found_inf = agreement.any_overflow
        no_data = agreement.weight <= 0
        self._unused = {id(p) for p, users in zip(self._trainable, agreement.ranks_using)
                        if users == 0 or no_data}
        divisor = self._window_divisor() * self.weights.divisor(
            agreement.weight, agreement.micro_steps, agreement.ranks_with_micro_steps, self.world)
        self._window_totals = (agreement.weight, agreement.micro_steps)
        if divisor != 1.0:
            for grad in grads:
                grad.div_(divisor)
        self._applied_divisor = divisor
        self.step_state.move(Phase.REDUCED)
        if self.stage == 0 and not self.rebuilds_optimizer and self._unused:
            with guard.engine_access():
                for param in (p for p in self._trainable if id(p) in self._unused):
                    param.grad = None  # as DDP leaves it: torch optimizers then skip it

    def note_params_written(self) -> None:
        """The engine wrote parameter values: remember their version counters."""
        if self.separate_master:
            self._param_versions = [p._version for p in self._trainable]

    def _check_no_stray_writes(self) -> None:
        """With a separate fp32 master, a write into a parameter would be overwritten by the
        next step: refuse it instead of losing it."""
        if not self.separate_master:
            return
        for param, version in zip(self._trainable, self._param_versions):
            if param._version != version:
                raise ConfigError(
                    f"parameter {self._name_of.get(id(param), '?')} was modified in place after "
                    "shard(). With param_dtype or offload_optimizer the optimizer steps an fp32 "
                    "master copy and would overwrite the change. Write parameters through "
                    "model.load_state_dict(...) or `with model.summon_full_params(): ...`.")

    def _check_trainable_set(self) -> None:
        """A parameter frozen at shard() has no bucket: its gradient would never be reduced."""
        unfrozen = [self._name_of.get(id(p), "?") for p in self._frozen_at_wrap if p.requires_grad]
        if unfrozen:
            raise ConfigError(
                f"parameter(s) {unfrozen[:5]} were frozen (requires_grad=False) when shard() was "
                "called and are trainable now; the engine never reduces or steps them. Set "
                "requires_grad before shard() (freezing a parameter later is fine: it is then "
                "left untouched), or shard the model again.")

    def _window_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets if not b.window_fresh and b.grad_shard is not None]

    # ------------------------------------------------------------------ optimizer

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.original_groups = [list(group["params"]) for group in optimizer.param_groups]
        if self.rebuilds_optimizer:
            check_shardable(optimizer, self.config.allow_unknown_optimizer)
            pieces = [[piece.param for b in self.buckets if b.group_index == index and b.master is not None
                       for piece in b.split_master()] for index in range(len(optimizer.param_groups))]
            optimizer = rebuild_over(optimizer, pieces)
        self.optimizer = optimizer
        attach_optimizer(optimizer, self)
        return optimizer

    def _stepped_buckets(self) -> list[FlatBucket]:
        return [b for b in self.buckets if b.master is not None]

    def before_step(self) -> None:
        join.announce(self, Announcement.STEP)
        self.finish_gradient_sync()
        if not self.rebuilds_optimizer:
            with guard.engine_access():
                for param in (p for p in self._trainable if id(p) in self._unused):
                    param.grad = None  # torch optimizers skip a parameter with no gradient
            return
        skip = self.scaler is not None and self._found_inf
        for bucket in self._stepped_buckets():
            unused = frozenset(i for i, p in enumerate(bucket.params) if id(p) in self._unused)
            bucket.set_piece_grads(None if skip else bucket.master_grad(), unused)

    def after_step(self) -> None:
        self.counters.steps += 1
        if self.rebuilds_optimizer:
            skipped = self.scaler is not None and self._found_inf
            if not skipped:
                for bucket in self._stepped_buckets():
                    bucket.copy_master_to_params()
                self._sync_params_after_step()
                self.note_params_written()
            if self.scaler is not None:
                self.scaler.update(skipped)
                self._found_inf = False
        self._end_grad_window()

    def _sync_params_after_step(self) -> None:
        pass  # stage 0: every rank stepped everything

    def _end_grad_window(self) -> None:
        """The step consumed the gradients; the next backward starts from zero."""
        self._unused = set()
        self._used_flags[:] = bytes(len(self._used_flags))
        self.weights.end_window(*getattr(self, "_window_totals", (0.0, 0)))
        self._window_totals, self._applied_divisor = (0.0, 0), 1.0
        guard.set_grad_sharded(self._trainable, False)
        for bucket in self.buckets:
            bucket.window_fresh = True
            bucket.local_factor = 1.0
            bucket.set_piece_grads(None)
            if bucket.full_grad is not None and self.stage <= 1:
                if self._adopts_grads(bucket):
                    for param in bucket.params:
                        param.grad = None  # adopt_grad treats None as zero
                else:
                    bucket.full_grad.zero_()
        self.step_state.end_window()

    def zero_grad(self) -> None:
        self._end_grad_window()
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None

    # ------------------------------------------------------------------ clipping

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        join.announce(self, Announcement.CLIP, aux=(float(max_norm), float(norm_type)))
        self.finish_gradient_sync()
        grads = self._window_grads()
        device = device_of(self.module, allow_meta=True)
        replicated = self.stage == 0  # every rank holds the same full gradients
        # The shard group holds each element once; its replicas hold the same shards again.
        shards = self.comm.shard
        total = torch.zeros(1, device=device)
        if norm_type == math.inf:
            for grad in grads:
                total = torch.maximum(total, grad.abs().max().float().reshape(1))
            if not replicated:
                shards.all_reduce_max(total, label="clip")
            total = total[0]
        else:
            for grad in grads:
                total += grad.float().abs().pow(norm_type).sum()
            if not replicated:
                shards.all_reduce(total, label="clip").wait()
            total = total[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
        self.step_state.move(Phase.CLIPPED)
        return total

    def broadcast_replicas(self, src: int) -> None:
        """Stage 0 after ``model.join()``: rank ``src``'s parameters and optimizer state for all."""
        for bucket in self.buckets:
            self.comm.broadcast(bucket.full_param, src=src, label="join")
            if self.separate_master and bucket.master is not None:
                self.comm.broadcast(bucket.master, src=src, label="join")
        if self.optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            for param in params:
                state = self.optimizer.state.get(param, {})
                for key in sorted(state):
                    if torch.is_tensor(state[key]):
                        self.comm.broadcast(state[key], src=src, label="join")
        self.note_params_written()

    # ------------------------------------------------------------------ failure

    def check_usable(self) -> None:
        self.step_state.check_usable()

    def fail(self, what: str) -> None:
        """This rank's collectives may be out of step with the others': stop for good.

        Raises now and at every later engine call; the group is torn down so the
        other ranks' pending collectives fail at once instead of waiting out the timeout.
        """
        if self.step_state.broken is None:
            self.step_state.broken = (
                f"rank {self.comm.rank}: {what} (after {self.counters.steps} optimizer steps); the "
                "ranks' collectives can no longer be paired, so this engine stopped. Every rank "
                "must run the same forwards, backwards and steps; handle the error on every rank "
                "(or none) and resume from the last checkpoint.")
            self.comm.abort(self.step_state.broken)
        raise CollectiveError(self.step_state.broken)

    def forward_failed(self, error: BaseException) -> None:
        """An exception left a forward pass: with several ranks, training cannot go on."""
        self.step_state.forward_depth = 0
        if isinstance(error, CollectiveError):  # a peer failed first: its cause, not ours
            self.step_state.broken = self.step_state.broken or str(error)
            return
        if self.world > 1 and (torch.is_grad_enabled() or self.stage == 3):
            try:
                self.fail(f"a forward pass raised on rank {self.comm.rank}")
            except CollectiveError:
                pass  # the original exception is the one to show now


# ---------------------------------------------------------------------- helpers


def _make_scaler(config: ShardConfig) -> Optional[DynamicLossScaler]:
    if config.param_dtype != torch.float16:
        return None
    if config.loss_scale in (None, "dynamic"):
        return DynamicLossScaler(scale=float(config.initial_loss_scale))
    fixed = float(config.loss_scale)
    return DynamicLossScaler(scale=fixed, growth_factor=1.0, backoff_factor=1.0, min_scale=fixed)


def _any_nonfinite(grads: list[torch.Tensor]) -> bool:
    return any(bool((~torch.isfinite(grad)).any()) for grad in grads)


def device_of(module: nn.Module, allow_meta: bool = False) -> torch.device:
    with guard.engine_access():
        devices = {p.device for p in module.parameters() if not p.is_meta}
        meta = any(p.is_meta for p in module.parameters())
    if len(devices) > 1:
        raise ConfigError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                          "move the model to one device first")
    if devices:
        return devices.pop()
    if meta and not allow_meta:
        raise ConfigError("the model is on the meta device; only stage 3 materializes a meta "
                          "model (shard by shard). Build it on a real device or use stage=3")
    return torch.device("cuda", torch.cuda.current_device()) if current_backend() == "nccl" \
        else torch.device("cpu")
