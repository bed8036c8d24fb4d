"""One rank's engine: the state of a sharded model, and the collaborators that act on it.

``shard(stage=s)`` builds ``StageEngine(STAGES[s], ...)``: the recipe
(stages/recipes.py) gives the stage's facts (``spec``) and its three
stage-specific collaborators; the rest are the same at every stage. Each
collaborator owns one behaviour. ``__init__`` wires it once: each receives only what
it uses (callables for what this engine replaces or makes later; ``connect`` for partners
built after it), and none holds this engine (tests/architecture/test_engine_wiring.py):

==================  ========================  =================================================
``forward``         forward.py                the root's forward hooks, the output hooks
``backward``        backward.py               gradient hooks, backward's start and end
``grads``           gradients.py (per stage)  how a bucket's gradient is stored and reduced
``layout``          buckets / unit_scheduler  where parameters live; what backward reduces
``publication``     publication.py            how updated parameters reach every rank
``window``          window.py                 the gradient window's agreement and reset
``stepping``        stepping.py               the optimizer's wrap, step and clipping
``in_backward``     in_backward.py            ``step_in_backward``: the step where gradients land
``failure``         failure.py                stopping for good
``reports``         reports.py                bytes sent and memory held
==================  ========================  =================================================

Code outside stages/ sees this object through the ``Engine`` protocol
(engine_api.py); replan.py grows its plan when the trainable set changes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
from torch import nn

from ..activations.blocks import BlockActivations, model_blocks
from ..config import ShardConfig
from ..distributed.compression.collectives import CompressedCollectives
from ..distributed.hybrid import HybridCommunicator
from ..flat import guard
from ..flat.bucket import FlatBucket
from ..flat.storage import StoragePlan, Tier
from ..offload.disk_params import DiskParams
from ..offload.disk_tier import DiskTier
from ..memory import LiveBytes
from ..optim.sharded_optimizer import attach_optimizer
from ..optim.whole_tensor import BucketLayouts
from ..step import join
from ..step.agreement import ProgressCounters
from ..step.batch_weights import BatchWeights
from ..step.call_agreement import RAISED_FORWARD, CallAgreement
from ..step.mixed_precision import DynamicLossScaler
from ..step.phase import StepState
from ..step.reducer import OrderedReducer
from .backward import BackwardHooks, BackwardSources
from .compile_support import eager_hook
from . import forward_methods, replan
from .failure import FailureHandling
from .forward import ForwardHooks, ForwardSources
from .gradients import GradientSources
from .in_backward import InBackwardSources, StepInBackward, refuse
from .layout_sources import BucketPolicy, LayoutSources, UnitSources
from .params import ParamIndex
from .publication import PublicationSources
from .recipes import StageRecipe
from .reports import ReportSources, StageReports
from .stepping import OptimizerSteps, StepSources
from .weak_hook import weak_method_hook
from .window import GradientWindow, WindowSources


class StageEngine:
    """One rank's engine for one ZeRO stage (see the module docstring for its collaborators)."""

    def __init__(self, recipe: StageRecipe, module: nn.Module, comm: HybridCommunicator, config: ShardConfig,
                 group_of: dict[int, int], whole_tensor_groups: frozenset[int] = frozenset(),
                 optimizer: Optional[torch.optim.Optimizer] = None):
        """``group_of``: ``id(param) -> param group index``; ``whole_tensor_groups``: the groups
        whose optimizer needs whole parameters (optim/whole_tensor.py); ``optimizer``: the
        user's, read (never stepped) to size a device budget (stages/unit_tiers.py)."""
        self.spec = recipe.spec
        self.module, self.comm, self.config = module, comm, config
        self.storage = StoragePlan.from_config(config)  # which tier holds what (flat/storage.py)

        self.disk = DiskTier(config.offload_path, lambda: self.optimizer, self.stepped_buckets) \
            if self.storage.optimizer is Tier.DISK else None
        self.disk_params = DiskParams(self.disk, self.current_buckets) \
            if self.storage.params is Tier.DISK else None  # stage 3
        self.live = LiveBytes()
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.sync_enabled = True                         # False inside no_sync()
        self.scaler = _make_scaler(config)
        self.counters = ProgressCounters()
        self.weights = BatchWeights()
        self.step_state = StepState()                    # the step's phase (step/phase.py)
        self.join_state = join.JoinState(self.step_state)
        self.calls = CallAgreement(comm.world, self.spec.stage)  # model.state_dict() & co (step/call_agreement.py)
        self.params = ParamIndex(module)
        self.original_groups: list[list[nn.Parameter]] = []  # the user's param groups
        self.replans: list = []                          # stages/replan.py: what each growth of the plan cost
        self.compression: Optional[CompressedCollectives] = None  # None: exact collectives
        self.forward = ForwardHooks(_forward_sources(self))
        self.failure = FailureHandling(
            comm, self.step_state, self.counters, self.forward.forget_records,
            (lambda: self.layout.forward_raised()) if self.spec.forward_communicates else None,
            (lambda: self.calls.announce(self, RAISED_FORWARD)) if self.calls.active else None)
        self.window = GradientWindow(_window_sources(self))
        self.backward = BackwardHooks(_backward_sources(self))
        self.stepping = OptimizerSteps(_step_sources(self))
        self.grads = recipe.gradients.wire(GradientSources(
            comm, self.current_buckets, lambda: self.compression, self.live, config.step_in_backward,
            config.max_inflight_buckets))
        self.in_backward = StepInBackward(InBackwardSources(
            config.step_in_backward, whole_tensor_groups, self.spec.divides_on_landing,
            self.spec.reduces_every_micro_step, comm, self.counters, self.weights, self.params, self.window,
            self.stepping, self.grads, self.forward.sync_device, self.stepped_buckets))
        self.layout = recipe.layout.wire(_layout_sources(self, whole_tensor_groups, optimizer))
        self.publication = recipe.publication.wire(PublicationSources(
            comm, self.current_buckets, self.stepped_buckets, lambda: self.compression,
            config.reshard_after_forward))
        if self.spec.guards_params:
            self._guard_params()
        self.buckets: list[FlatBucket] = self.layout.make_buckets(group_of)
        self.reindex()
        scaler = self.scaler
        self.compression = CompressedCollectives.create(
            config.compression, comm, self.spec.steps_whole, self.buckets,
            (lambda: float(scaler.scale)) if scaler is not None else (lambda: 1.0), self.live)
        self.reducer = OrderedReducer(self.layout.launch, self.layout.expected_grads, self.grads.max_inflight())
        self._connect_partners()
        self.layout.broadcast_rest()
        self.grads.prepare()
        self.activations = BlockActivations(  # checkpointing, offload, their bytes (activations/)
            module, model_blocks(module, config.wrap, config.wrap_min_params), config.activations,
            self.forward.sync_device(), eager_hook)
        self.reports = StageReports(ReportSources(
            comm, self.storage, self.grads, self.layout, self.publication, self.params, self.live,
            self.activations, self.disk, self.disk_params, config.broadcast_buffers, lambda: self.buffers,
            self.current_buckets, lambda: self.optimizer, lambda: self.compression))
        self.handles = self._register_hooks()
        forward_methods.note_modules(self)  # se.register_forward_method finds the engine

    def _connect_partners(self) -> None:
        """Hand each collaborator the partners built after it, once, before any hook is
        registered (see [Note: partners wired after construction] in window.py): in_backward
        steps through stepping and releases through grads; stepping publishes."""
        self.grads.connect(self.in_backward)
        self.stepping.connect(self.in_backward, self.publication)
        self.window.connect(self.reducer, self.stepping, self.in_backward, self.grads)
        self.backward.connect(self.grads, self.layout, self.reducer, self.in_backward)
        self.forward.connect(self.failure, self.backward, self.layout)

    def _guard_params(self) -> None:
        """The partial-gradient and sharded-parameter guards on each parameter (flat/guard.py)."""
        for name, param in self.module.named_parameters():
            guard.attach(param, name, self.spec.stage)
        guard.forget_when_collected(self, list(self.module.parameters()))

    def __deepcopy__(self, memo: dict) -> "StageEngine":
        # copy.deepcopy(model.module) reaches the engine through its hooks (bound methods):
        # the copy shares the engine, whose hooks ignore any module but the one it wraps.
        return self

    # ------------------------------------------------------------------ the Engine view

    @property
    def hook_ids(self) -> set[int]:
        """Ids of the hooks this engine registered (deepcopy drops them from copies)."""
        return {handle.id for handle in self.handles}

    def remove_hooks(self) -> None:
        """Remove every hook this engine registered: the module is then a plain module again
        (its parameters hold whatever the engine left in them) and the engine unusable."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @contextlib.contextmanager
    def syncing(self, enabled: bool) -> Iterator[None]:
        """Gradients reduced at each backward (``enabled``) or deferred (``no_sync()``) inside."""
        if not enabled and self.in_backward.enabled:
            raise refuse("no_sync() (gradient accumulation over micro-steps)",
                         "Call optimizer.step() after every backward, or drop step_in_backward to accumulate.")
        previous, self.sync_enabled = self.sync_enabled, enabled
        try:
            yield
        finally:
            self.sync_enabled = previous

    @contextlib.contextmanager
    def summoning(self) -> Iterator[None]:
        """Inside ``summon_full_params()`` (state/full_state.py): a forward there is refused."""
        self.step_state.summoned = True
        try:
            yield
        finally:
            self.step_state.summoned = False

    # ------------------------------------------------------------------ policy

    @property
    def separate_master(self) -> bool:
        """The optimizer steps an fp32 master apart from the parameters."""
        return self.config.mixed_precision or self.storage.separate_master

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are now, read at each broadcast: one re-assigned after
        ``shard()`` (``module.buf = module.buf + 1``, a new tensor) is the one sent, as DDP reads
        the module's buffers again before each broadcast."""
        return [b for b in self.module.buffers() if b.numel() > 0]

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        return self.config.reduce_dtype or self.config.param_dtype

    def current_buckets(self) -> list[FlatBucket]:
        """The plan's buckets as they are now (collaborators read them at each use: replan.py
        grows the plan)."""
        return self.buckets

    def stepped_buckets(self) -> list[FlatBucket]:
        """The buckets the optimizer steps (those with a master)."""
        return [b for b in self.buckets if b.master is not None]

    # ------------------------------------------------------------------ wrap time

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``stepping.wrap_optimizer``'s result: this engine's optimizer, tied to it by the
        step's hooks (optim/sharded_optimizer.py)."""
        self.optimizer = optimizer
        attach_optimizer(optimizer, self)

    def reindex(self) -> None:
        """The parameter lookups after the plan was made or grew."""
        self.params.index(self.buckets)
        self.window.note_params_written()

    def _register_hooks(self) -> list:
        on_grad = weak_method_hook(self.backward.on_param_grad)  # see [Note: why parameter hooks ...]
        handles = [p.register_post_accumulate_grad_hook(on_grad)
                   for b in self.buckets if b.requires_grad for p in b.params]
        handles.append(self.module.register_forward_pre_hook(eager_hook(self.forward.root_pre_forward),
                                                             with_kwargs=True))
        handles.append(self.module.register_forward_hook(eager_hook(self.forward.root_post_forward)))
        return handles + self.layout.register_hooks() + self.activations.register()


# ---------------------------------------------------------------------- what the hooks and the window receive
# Built once, in StageEngine.__init__; the partners made after them come through their
# ``connect`` (see [Note: partners wired after construction] in window.py). What needs the
# whole engine (the call agreement, model.join()'s bookkeeping, replan.py) is handed over as
# a callable bound here, as failure's ``announce_raised`` is; what the engine replaces or
# toggles later (the buckets, the optimizer, no_sync()) is read through a callable at each use.


def _forward_sources(engine: StageEngine) -> ForwardSources:
    return ForwardSources(
        engine.spec.forward_communicates, engine.config.param_dtype, engine.module, engine.comm,
        engine.step_state, engine.counters, engine.weights, engine.params, engine.scaler,
        functools.partial(engine.calls.check, engine), functools.partial(join.announce, engine),
        functools.partial(join.note_inputs, engine), functools.partial(join.note_outputs, engine),
        functools.partial(replan.replan_if_grown, engine))


def _window_sources(engine: StageEngine) -> WindowSources:
    return WindowSources(
        engine.spec.divides_on_landing, engine.spec.keeps_full_grads, engine.separate_master, engine.comm,
        engine.step_state, engine.join_state, engine.counters, engine.weights, engine.params, engine.scaler,
        engine.failure, engine.current_buckets, lambda: engine.optimizer, engine.forward.sync_device,
        functools.partial(engine.calls.check, engine), functools.partial(replan.plan_digest, engine),
        functools.partial(replan.changed_inside_window, engine),
        lambda: engine.original_groups + engine.stepping.pending_groups)


def _backward_sources(engine: StageEngine) -> BackwardSources:
    return BackwardSources(
        engine.spec.reduces_every_micro_step, engine.spec.normalizes_each_backward, engine.spec.guards_params,
        engine.config.broadcast_buffers, engine.comm, engine.step_state, engine.counters, engine.weights,
        engine.params, engine.failure, engine.window, engine.current_buckets, lambda: engine.buffers,
        lambda: engine.sync_enabled, functools.partial(engine.calls.check, engine),
        functools.partial(join.announce, engine), functools.partial(join.backward_done, engine))


def _step_sources(engine: StageEngine) -> StepSources:
    return StepSources(
        engine.spec.shards_optimizer, engine.separate_master, engine.spec.grads_replicated,
        engine.config.step_in_backward, engine.config.allow_unknown_optimizer, engine.config.whole_tensor_optimizers,
        engine.comm, engine.current_buckets, engine.stepped_buckets, engine.original_groups, lambda: engine.optimizer,
        engine._adopt_optimizer, functools.partial(join.announce, engine), engine.counters, engine.step_state,
        engine.scaler, engine.params, engine.window, engine.disk, engine.forward.sync_device)


def _layout_sources(engine: StageEngine, whole_tensor_groups: frozenset[int],
                    sizing_optimizer: Optional[torch.optim.Optimizer]) -> LayoutSources:
    config = engine.config
    return LayoutSources(
        engine.module, engine.comm, engine.current_buckets, BucketPolicy(
            BucketLayouts(engine.comm.group_size), engine.storage, whole_tensor_groups, engine.spec.steps_whole,
            config.mixed_precision, config.param_dtype, engine.grad_dtype, engine.stepping.rebuilds_optimizer,
            engine.disk),
        config.bucket_bytes, config.stage3, engine.spec.buckets_end_at_units, engine.grads,
        engine.forward.sync_device, UnitSources(
            config.offload, sizing_optimizer, engine.step_state, engine.live, engine.disk_params,
            lambda: engine.compression, lambda unit: engine.reducer.arrivals(unit), engine.failure, engine.backward))


def _make_scaler(config: ShardConfig) -> Optional[DynamicLossScaler]:
    if config.param_dtype != torch.float16:
        return None
    if config.loss_scale in (None, "dynamic"):
        return DynamicLossScaler(scale=float(config.initial_loss_scale))
    fixed = float(config.loss_scale)
    return DynamicLossScaler(scale=fixed, growth_factor=1.0, backoff_factor=1.0, min_scale=fixed)
