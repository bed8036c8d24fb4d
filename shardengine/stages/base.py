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

[Note: how a stage differs]
A stage is a subclass that changes two kinds of thing, both fixed by its class:
*facts* (class attributes at the top of ``DataParallel``: are parameters
guarded, are gradients replicated, does the full gradient persist, is each
reduction averaged as it lands, does an eval forward communicate) and *steps*
(overridable methods: how a gradient is stored, how a bucket is reduced and
where the result is kept, how parameters are published after the step, and at
stage 3 how units are gathered and freed). The shared code reads the facts and
calls the steps; it never asks which stage it is. ``DataParallel`` itself is
composed of mixins, one file each: forward.py (the root's forward hooks),
backward.py (gradient hooks and reductions), window.py (the window's agreement
and normalization), stepping.py (optimizer wiring and clipping, clipping.py),
failure.py (stopping for good), reports.py (bytes and memory); this file keeps
construction, the stage facts and the Engine view, and replan.py grows the plan
when the trainable set changes (a stage says how in ``_grow_plan``).

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

from typing import Optional

import torch
from torch import nn

from ..flat import guard
from ..step import join
from ..distributed.compression.collectives import CompressedCollectives
from ..config import ShardConfig
from ..flat.bucket import FlatBucket
from ..flat.storage import StoragePlan
from ..distributed.hybrid import HybridCommunicator
from ..memory import LiveBytes
from ..flat.plan import plan_replicated_buckets
from ..step.mixed_precision import DynamicLossScaler
from ..step.reducer import OrderedReducer
from ..step.agreement import ProgressCounters
from ..step.phase import Phase, StepState
from ..step.batch_weights import BatchWeights, ForwardWeight
from ..step.call_agreement import CallAgreement
from ..optim.whole_tensor import BucketLayouts
from . import replan
from .compile_support import eager_hook
from .backward import BackwardHooks
from .devices import device_of
from .failure import FailureHandling
from .forward import ForwardHooks
from .reports import StageReports
from .stepping import OptimizerSteps
from .weak_hook import weak_method_hook
from .window import GradientWindow


class DataParallel(ForwardHooks, BackwardHooks, GradientWindow, OptimizerSteps, FailureHandling, StageReports):
    """Stage 0: every rank holds everything; gradients are averaged with all-reduce."""

    stage = 0
    # What differs between stages, fixed per class (each stage file sets its own):
    guards_params = False          # parameters get the stage-3/partial-gradient guards (flat/guard.py)
    steps_whole = True             # every rank steps whole buckets (no owned slices)
    grads_replicated = True        # every rank holds the same reduced gradients (clipping needs no sum)
    keeps_full_grads = True        # the full gradient buffer persists across micro-steps
    divides_on_landing = True      # each reduction is averaged as it lands (else summed, divided at the step)
    normalizes_each_backward = True  # DDP's contract: after a synchronizing backward p.grad is the average
    forward_communicates = False   # an eval forward runs collectives too (stage 3 gathers)

    def __init__(self, module: nn.Module, comm: HybridCommunicator, config: ShardConfig,
                 group_of: dict[int, int], whole_tensor_groups: frozenset[int] = frozenset()):
        """``group_of``: ``id(param) -> param group index``; ``whole_tensor_groups``: the groups
        whose optimizer needs whole parameters (optim/whole_tensor.py)."""
        self.module, self.comm, self.config = module, comm, config
        self.storage = StoragePlan.from_config(config)  # which tier holds what (flat/storage.py)
        self.whole_tensor_groups = whole_tensor_groups
        self._layouts = BucketLayouts(comm.group_size)  # owners of whole-tensor buckets
        self.world = comm.world_size
        self.live = LiveBytes()
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.sync_enabled = True
        self.scaler = _make_scaler(config)
        self.counters = ProgressCounters()
        self.weights = BatchWeights()
        self.step_state = StepState()      # the step's phase (step/phase.py)
        self.join_state = join.JoinState(self.step_state)
        self.calls = CallAgreement(comm.world, self.stage)  # model.state_dict() & co (step/call_agreement.py)
        self._factor = 1.0                 # the running micro-step's batch-weight factor
        self._weight_fixed = False         # the running backward's weight is known (step/batch_weights.py)
        self._forward_records: list[Optional[ForwardWeight]] = []  # per root forward in progress
        self._name_of = {id(p): name for name, p in module.named_parameters()}
        self._applied_divisor = 1.0        # what the window's gradients were divided by
        self._found_inf = False            # fp16: the window's agreement saw an overflow
        self._unused: set[int] = set()     # ids of params that got no gradient on any rank
        self.original_groups: list[list[nn.Parameter]] = []  # the user's param groups
        self.pending_groups: list[list[nn.Parameter]] = []   # add_param_group'd, planned at the next forward
        self.replans: list = []            # stages/replan.py: what each growth of the plan cost
        if self.guards_params:
            for name, param in module.named_parameters():
                guard.attach(param, name, self.stage)
            guard.forget_when_collected(self, list(module.parameters()))
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

    def is_param(self, param: object) -> bool:
        """Whether ``param`` is a parameter of the wrapped module."""
        return id(param) in self._name_of

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        """The parameters reduced and stepped (trainable at ``shard()``), in bucket order."""
        return self._trainable

    @property
    def hook_ids(self) -> set[int]:
        """Ids of the hooks this engine registered (deepcopy drops them from copies)."""
        return {handle.id for handle in self._handles}

    def remove_hooks(self) -> None:
        """Remove every hook this engine registered: the module is then a plain module again
        (its parameters hold whatever the engine left in them) and the engine unusable."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

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
        return self.separate_master

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        return self.config.reduce_dtype or self.config.param_dtype

    def _adopts_grads(self, bucket: FlatBucket) -> bool:
        """``param.grad`` can be a view into the bucket (same dtype, persistent buffer)."""
        return self.keeps_full_grads and bucket.grad_dtype == bucket.dtype

    def _max_inflight(self) -> Optional[int]:
        return None  # stages 0-1 keep gradients anyway: no buffer to bound

    @property
    def _compresses_grads(self) -> bool:
        return self.compression is not None and self.compression.grads is not None

    # ------------------------------------------------------------------ wrap time

    def _make_buckets(self, group_of: dict[int, int]) -> list[FlatBucket]:
        device = device_of(self.module)
        buckets = []
        whole = frozenset() if self.steps_whole else self.whole_tensor_groups  # stage 0 steps all
        for plan in plan_replicated_buckets(self.module, group_of, self.config.bucket_bytes, whole,
                                            self.comm.group_size):
            bucket = self._new_bucket(plan.params, plan.group_index, device)
            self._finish_bucket(bucket)
            buckets.append(bucket)
        return buckets

    def _new_bucket(self, params: list[nn.Parameter], group_index, device) -> FlatBucket:
        # Laid out over the shard group (all ranks unless hybrid, see distributed/hybrid.py).
        whole = group_index in self.whole_tensor_groups and params[0].requires_grad
        layout = self._layouts.layout([tuple(p.shape) for p in params], whole, steps_whole=self.steps_whole)
        return FlatBucket(params, group_index, self.comm.shard.rank, self.comm.group_size, device,
                          steps_whole=self.steps_whole, whole_tensor=whole, layout=layout)

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

    def _grow_plan(self, newly: list[nn.Parameter], group_of: dict[int, int]) -> list[FlatBucket]:
        """Parameters trainable since the plan (stages/replan.py): frozen ones are held whole
        on every rank, outside any bucket, so they get buckets of their own."""
        return replan.new_replicated_buckets(self, newly, group_of)

    def _prepare_grads(self) -> None:
        for bucket in self.buckets:  # persistent; param.grad may be views into it
            bucket.alloc_full_grad()

    def _register_hooks(self) -> None:
        self._handles = [p.register_post_accumulate_grad_hook(weak_method_hook(self._on_param_grad))
                         for b in self.buckets if b.requires_grad for p in b.params]
        self._handles.append(self.module.register_forward_pre_hook(eager_hook(self._root_pre_forward),
                                                                   with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(eager_hook(self._root_post_forward)))


# ---------------------------------------------------------------------- helpers


def _make_scaler(config: ShardConfig) -> Optional[DynamicLossScaler]:
    if config.param_dtype != torch.float16:
        return None
    if config.loss_scale in (None, "dynamic"):
        return DynamicLossScaler(scale=float(config.initial_loss_scale))
    fixed = float(config.loss_scale)
    return DynamicLossScaler(scale=fixed, growth_factor=1.0, backoff_factor=1.0, min_scale=fixed)

