"""Exact per-rank bytes of shardengine for a given module: padding, buckets and units included.

Given a module (a meta-device copy is enough) the estimator does not approximate
Ψ/N: it asks :func:`shardengine.flat.plan.count_elements` — the planner the engine itself
builds its flat buckets from — how many elements each rank will hold, and accounts
them exactly as ``ShardedModel.memory_report()`` does (see ``shardengine/stages/reports.py``):

=========  ===============================  ===================  =======================================
stage      params                           grads                optimizer_states
=========  ===============================  ===================  =======================================
0          p·padded + p·frozen              g·padded             fp32: K·Ψ on the original parameters;
                                                                 mixed: (4 + K)·padded (whole buffers)
1          p·padded + p·frozen              g·padded             (master + K)·shard
2          p·padded + p·frozen              g·shard              (master + K)·shard
3          p·frozen_shard (+ p·shard        g·shard              (master + K)·shard
           without a master)
=========  ===============================  ===================  =======================================

Hybrid sharding (``EngineOptions.shard_group_size=k``): stages 1-3 are planned over the k
ranks of a shard group (the table with N -> k), stage 0 over all N (see :func:`exact_engine_model`).

p: compute bytes (2 under bf16/fp16 and pure-bf16/fp16, else 4); g: reduce bytes
(default p); K: optimizer state bytes per element (Adam 8, SGD-momentum 4, SGD 0; half
under a pure low-precision policy, whose optimizer steps the bf16/fp16 weights
themselves; the scalar ``step`` is not counted); master: 4 when mixed precision or
offload keeps a separate fp32 copy (the optimizer state over it is then fp32), else 0.
Stage 3 keeps no compute-dtype slice of a trainable bucket beside a separate master (it
casts the master into the gather buffer: flat/bucket.py, [Note: no compute copy beside a
master]); without one the slice is the master, counted once, under params.
With offload the optimizer term moves to ``host_optimizer_states`` (``zero3-offload-params``:
the params and grads terms to ``host_params`` / ``host_grads`` as well, and the fp32 master,
then a trained bucket's only parameter shard, from the optimizer term to ``host_params``);
the disk tier's plans
(``zero3-offload-disk``, ``zero3-offload-params-disk``) move the optimizer term, and the params
term, to the plan's ``disk`` bytes instead: ``memory_report().disk_optimizer_states`` and
``disk_params`` (the gradients stay in ``host_grads``).

[Note: the peak is a max, not a sum]
Activations peak at the end of forward / start of backward and are freed by its end;
the gradient buffers of the last reductions and the optimizer step's temporaries (fp32
master gradients under mixed precision, Adam's ``sqrt``/division buffers) come after.
So the transient peak is ``max(activations + buffers live with them, late buffers)``,
reported as ``activations + working_set`` with
``working_set = max(buffers live with the activations, late buffers - activations)``.
Buffers live with the activations: stage 2, the gradient bucket being filled; stage 3,
the gathered root unit, the running and prefetched blocks and one unit's gradient.

[Note: stage 3 without resharding after forward]
``shard(stage=3, reshard_after_forward=False)`` (``EngineOptions.reshard_after_forward``) keeps
each unit gathered from its forward until its backward is over (shardengine/stages/units.py:
``post_forward`` frees nothing, ``release_unit`` frees a unit once its gradients have all
arrived). So at the end of forward every unit is gathered, and the first unit backward
reaches is freed *before* its reduction allocates its gradient buffers (stages/backward.py:
``after_arrival`` runs before ``launch_ready``); with one reduction in flight each later unit's
buffers wait for the previous reduction to complete (step/reducer.py), by when more units are
freed. The buffers alive with the activations are then ``max(p·all, p·(all - U) + g·grad(U))``
over the blocks U (all: every unit's padded elements; grad: its padded gradient and slice):
the engine's tracked peak (``peak_comm_buffers``) byte for byte when the block backward reaches
first attains the max (equal blocks), an upper bound otherwise. With ``max_inflight_buckets=k``
the j-th release (j <= k) may find j reductions in flight: ``p·(all - j smallest blocks) + g·(j
largest gradients)`` joins the max (resharding stage 3 counts its k largest gradients). The
late buffers are stage 3's usual ones: every block is freed by then.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from torch import nn

from shardengine.engine_facts import (bucket_shares, BucketShape, BucketShare, count_elements, FlatLayout,
                               group_by_dtype, offloaded_units, plan_replicated_buckets, plan_unit_buckets,
                               resident_bytes_per_element, step_runs, unit_size, UnitCuts)

from .base import EngineTerms, nonzero
from .shardengine import offloaded_terms
from ..errors import EstimatorInputError
from ..terms.model_states import FP32_MASTER_BYTES, ModelStateBytes, PlanSpec, plan_spec
from ..terms.optimizers import ELEMENTWISE, STEPPED_BY_BUCKET, state_bytes_per_element, step_temporary_bytes
from ..terms.precision import Precision, precision_policy

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class EngineOptions:
    """The ``shard()`` options that change bytes (defaults are the engine's)."""

    bucket_mb: float = 25.0
    wrap: Optional[tuple[type, ...]] = None
    wrap_min_params: Optional[int] = None
    prefetch: int = 1
    max_inflight_buckets: int = 1
    reduce_precision: Optional[str] = None  # default: the compute precision
    # Stage 1 reduces into its persistent gradient's own slice (shardengine on Gloo with
    # collectives="auto"); else each bucket's reduced slice is a buffer of its own.
    reduces_in_place: bool = False
    # Hybrid sharding (shard(shard_group_size=k)): stages 1-3 laid out over k ranks, so
    # every per-rank term is the plain plan's on k ranks. None: over every rank.
    shard_group_size: Optional[int] = None
    # Stage 3: free each unit after its forward (shard(reshard_after_forward=...)); False keeps
    # every unit gathered until its backward ([Note: stage 3 without resharding after forward]).
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class EngineLayout:
    """What the engine's planner decides for one module on ``world_size`` ranks."""

    world_size: int
    replicated: object            # shardengine.flat.plan.ElementCounts for stages 0-2
    sharded: object               # ... for stage 3
    buckets: tuple[tuple[int, int], ...]     # stages 0-2: (padded, shard) per bucket
    units: tuple[tuple[int, int, int], ...]  # stage 3: (padded all, padded grad, shard grad), root last
    largest_param: int            # elements of the largest trainable parameter
    grad_tensors: int = 0         # trainable parameter tensors (one flag each in the step's agreement)
    buffer_groups: tuple[int, ...] = ()  # bytes of the buffers per dtype (broadcast after backward)
    bucket_shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per bucket, its parameters' shapes
    factored_numel: int = 0       # Adafactor's row + column statistics of the trainable parameters
    unit_bucket_shards: tuple[int, ...] = ()  # stage 3: each trainable bucket's shard (one bucket's step)
    # Per trainable bucket and rank, the elements of each optimizer piece (parameter fragment)
    # of its shard: what the step inside backward groups into capped runs (optim/step_groups.py).
    bucket_pieces: tuple[tuple[int, ...], ...] = ()       # stages 1-2
    unit_bucket_pieces: tuple[tuple[int, ...], ...] = ()  # stage 3
    unit_shares: tuple[tuple[BucketShare, ...], ...] = ()  # stage 3: per unit, its buckets (fractional offload)


def engine_layout(module: nn.Module, world_size: int, options: EngineOptions = EngineOptions(),
                  group_of: Optional[dict[int, int]] = None, cut_at_units: bool = False) -> EngineLayout:
    """Plan ``module`` (meta or real; nothing is allocated) exactly as ``shard()`` would.

    ``cut_at_units``: stage 2's buckets, which also end where a unit ends (shardengine's
    flat/plan.py, [Note: stage 2's buckets end at unit boundaries]); else stages 0-1's."""
    group_of = group_of if group_of is not None else {id(p): 0 for p in module.parameters()}
    common = dict(bucket_mb=options.bucket_mb, wrap=options.wrap,
                  wrap_min_params=options.wrap_min_params, group_of=group_of)
    replicated = count_elements(module, world_size, BucketShape(cut_at_units=cut_at_units), **common)
    sharded = count_elements(module, world_size, BucketShape(per_unit=True), **common)
    cuts = UnitCuts(options.wrap, options.wrap_min_params) if cut_at_units else None
    buckets, shapes, bucket_pieces = [], [], []
    for plan in plan_replicated_buckets(module, group_of, int(options.bucket_mb * 2**20), unit_cuts=cuts):
        layout = FlatLayout.build([p.shape for p in plan.params], world_size)
        buckets.append((layout.padded_numel, layout.shard_numel))
        shapes.append(tuple(tuple(p.shape) for p in plan.params))
        bucket_pieces += _pieces_per_rank(layout) if plan.params[0].requires_grad else []
    units, unit_bucket_shards, unit_bucket_pieces, unit_shares = [], [], [], []
    for _, _, plans in plan_unit_buckets(module, group_of, options.wrap, options.wrap_min_params):
        unit_shares.append(bucket_shares(plans, world_size))
        layouts = [(FlatLayout.build([p.shape for p in b.params], world_size), b.params[0].requires_grad)
                   for b in plans]
        unit_bucket_shards += [lay.shard_numel for lay, grad in layouts if grad]
        unit_bucket_pieces += [pieces for lay, grad in layouts if grad for pieces in _pieces_per_rank(lay)]
        units.append((sum(lay.padded_numel for lay, _ in layouts),
                      sum(lay.padded_numel for lay, grad in layouts if grad),
                      sum(lay.shard_numel for lay, grad in layouts if grad)))
    largest = max((p.numel() for p in module.parameters() if p.requires_grad), default=0)
    grad_tensors = sum(1 for p in module.parameters() if p.requires_grad and p.numel() > 0)
    buffers = [b for b in module.buffers() if b.numel() > 0]
    groups = tuple(sum(b.numel() * b.element_size() for b in same) for same in group_by_dtype(buffers))
    from ..model.stats import factored_numel_of

    factored = factored_numel_of(tuple(p.shape) for p in module.parameters() if p.requires_grad and p.numel())
    return EngineLayout(world_size, replicated, sharded, tuple(buckets), tuple(units), largest,
                        grad_tensors, groups, tuple(shapes), factored, tuple(unit_bucket_shards),
                        tuple(bucket_pieces), tuple(unit_bucket_pieces), tuple(unit_shares))


def _pieces_per_rank(layout: FlatLayout) -> list[tuple[int, ...]]:
    """Each rank's optimizer pieces of a bucket (``FlatBucket.split_master``), in elements."""
    return [tuple(f.param_end - f.param_start for f in layout.fragments(rank)) for rank in range(layout.world_size)]


def _bytes(policy: Precision, reduce_precision: Optional[str]) -> tuple[int, int]:
    param = policy.param_bytes
    grad = _DTYPE_BYTES[reduce_precision] if reduce_precision else param
    return param, grad


def _separate_master(policy: Precision, plan: PlanSpec) -> bool:
    """``ShardedModel.separate_master``: mixed precision or offload steps an fp32 copy."""
    return policy.mixed or plan.offload


def engine_state_bytes(layout: EngineLayout, plan: PlanSpec, precision: str, optimizer: str,
                       reduce_precision: Optional[str] = None) -> ModelStateBytes:
    """Per-rank params / grads / optimizer states exactly as ``memory_report()`` counts them."""
    if plan.partial_params:
        return partial_state_bytes(layout, plan, precision, optimizer, reduce_precision)
    policy = precision_policy(precision)
    p, g = _bytes(policy, reduce_precision)
    separate = _separate_master(policy, plan)
    master = FP32_MASTER_BYTES if separate else 0
    k = state_bytes_per_element(optimizer, FP32_MASTER_BYTES if separate else policy.state_bytes)
    if plan.stage == 3:
        counts = layout.sharded
        params = p * ((0 if separate else counts.shard) + counts.frozen_shard)
    else:
        counts = layout.replicated
        params = p * (counts.padded + counts.frozen)
    grads = g * (counts.shard if plan.stage >= 2 else counts.padded)
    if plan.stage == 0:
        # Without masters the user's optimizer steps the original parameters; with them
        # fp32 masters of the whole padded buffers, optimizer state per parameter (unpadded).
        optimizer_bytes = master * counts.padded + k * counts.trainable + _factored(layout, optimizer, policy, 1)
    else:
        # A flat master slice per bucket; optimizer state per parameter fragment, so padding
        # holds none (rank 0, which holds no padding, is the largest).
        optimizer_bytes = master * counts.shard + k * counts.owned + _factored(layout, optimizer, policy,
                                                                            layout.world_size)
    if plan.offload_params:  # the parameter and gradient shards move to the host with the master,
        # which is then a trained bucket's only parameter shard: reported as a parameter
        # (stages/reports.py, [Note: an offloaded master is a parameter])
        masters = master * counts.shard
        return ModelStateBytes(0, 0, 0, host_optimizer_states=optimizer_bytes - masters, host_params=params + masters,
                               host_grads=grads)
    if plan.offload:
        return ModelStateBytes(params, grads, 0, host_optimizer_states=optimizer_bytes)
    return ModelStateBytes(params, grads, optimizer_bytes)


def partial_state_bytes(layout: EngineLayout, plan: PlanSpec, precision: str, optimizer: str,
                        reduce_precision: Optional[str] = None) -> ModelStateBytes:
    """A fractional plan: the units shardengine.flat.residency moves to the host hold
    ``zero3-offload-params``' bytes, the others ``zero3``'s (the engine's own choice, from the
    same unit plan: stages/unit_tiers.py)."""
    policy = precision_policy(precision)
    p, g = _bytes(policy, reduce_precision)
    master = FP32_MASTER_BYTES if policy.mixed else policy.state_bytes
    states = state_bytes_per_element(optimizer, master) // master

    def per_element(share: BucketShare) -> int:
        return resident_bytes_per_element(share.trained, p, g, master, states, True)

    sizes = [unit_size(shares, per_element) for shares in layout.unit_shares]
    moved = offloaded_units(sizes, fraction=plan.params_fraction, budget=plan.device_budget)
    resident = engine_state_bytes(_units_only(layout, set(range(len(sizes))) - moved), plan_spec("zero3"),
                                  precision, optimizer, reduce_precision)
    host = engine_state_bytes(replace(_units_only(layout, moved), factored_numel=0),
                              plan_spec("zero3-offload-params"), precision, optimizer, reduce_precision)
    return ModelStateBytes(resident.params, resident.grads, resident.optimizer_states,
                           host_optimizer_states=host.host_optimizer_states, host_params=host.host_params,
                           host_grads=host.host_grads)


def _units_only(layout: EngineLayout, keep: set[int]) -> EngineLayout:
    """``layout`` with stage 3's counts of the units ``keep`` alone."""
    shares = [share for index, unit in enumerate(layout.unit_shares) if index in keep for share in unit]
    trained = [share for share in shares if share.trained]
    counts = replace(layout.sharded, trainable=sum(s.elements for s in trained),
                     padded=sum(s.shard for s in trained) * layout.world_size,
                     shard=sum(s.shard for s in trained), owned=sum(min(s.shard, s.elements) for s in trained),
                     frozen_shard=sum(s.shard for s in shares if not s.trained))
    return replace(layout, sharded=counts)


def _factored(layout: EngineLayout, optimizer: str, policy: Precision, ranks: int) -> int:
    """Adafactor's factored second moment (rows + columns per matrix, in fp32 at stage 0 over
    fp32 weights); whole matrices per owner above, so about 1/N of it per rank."""
    if optimizer != "adafactor":
        return 0
    state = FP32_MASTER_BYTES if policy.mixed else policy.state_bytes
    return -(-state * layout.factored_numel // ranks)


def _peak_buffers(layout: EngineLayout, plan: PlanSpec, p: int, g: int, options: EngineOptions) -> int:
    """Engine buffers alive together with the activation peak (end of forward, early backward)."""
    if plan.stage <= 1:
        return 0  # gradients reduce in place (0) or into small slices once a bucket completes (1)
    if plan.stage == 2:  # the bucket being filled: its gradients as autograd made them, in the compute
        # dtype, until the bucket is complete ([Note: a bucket's buffer at its reduction] in
        # shardengine/stages/gradients.py)
        return p * max((padded for padded, _ in layout.buckets), default=0)
    *blocks, root = layout.units
    # Each reduction in flight (up to ``max_inflight_buckets``) holds a unit's flat gradient and
    # reduced slice.
    in_flight = sorted((unit[1] + unit[2] for unit in layout.units), reverse=True)
    if not options.reshard_after_forward:  # [Note: stage 3 without resharding after forward]
        gathered = p * sum(unit[0] for unit in layout.units)
        first_released = max(gathered - p * unit[0] + g * (unit[1] + unit[2]) for unit in blocks or [root])
        # j reductions in flight once j blocks were released: at most the j largest gradients
        # beside all but the j smallest blocks.
        smallest = sorted(unit[0] for unit in blocks)
        later = [gathered - p * sum(smallest[:j]) + g * sum(in_flight[:j])
                 for j in range(2, min(options.max_inflight_buckets, len(blocks)) + 1)]
        return max([gathered, first_released] + later)
    # Stage 3: the root unit stays gathered through forward and backward; blocks are
    # gathered one at a time plus ``prefetch`` ahead; one unit's full gradient in flight.
    live_blocks = sorted((unit[0] for unit in blocks), reverse=True)[:1 + options.prefetch]
    return p * (root[0] + sum(live_blocks)) + g * sum(in_flight[:options.max_inflight_buckets])


def _late_buffers(layout: EngineLayout, plan: PlanSpec, p: int, g: int, options: EngineOptions) -> int:
    """Engine buffers at the end of backward, when the activations are (mostly) freed."""
    in_flight = options.max_inflight_buckets + 1  # launched ones plus the one being filled
    if plan.stage == 0:
        return 0
    if plan.stage == 1:  # every reduced slice until the flush, unless reduced in place
        return 0 if options.reduces_in_place else g * sum(shard for _, shard in layout.buckets)
    if plan.stage == 2:
        return g * sum(sorted((padded + shard for padded, shard in layout.buckets), reverse=True)[:in_flight])
    grads = sorted((unit[1] + unit[2] for unit in layout.units), reverse=True)[:in_flight]
    return p * layout.units[-1][0] + g * sum(grads)


def _master_grad_bytes(policy: Precision, g: int) -> int:
    """Bytes per stepped element of the gradient copy the step makes in the master's dtype:
    ``FlatBucket.master_grad`` is a view where the reduced gradient already is fp32 (``reduce_dtype``
    fp32, as FSDP2's ``MixedPrecisionPolicy(bf16, reduce_dtype=fp32)``), a copy otherwise."""
    return FP32_MASTER_BYTES if policy.mixed and g != FP32_MASTER_BYTES else 0


def _largest_pieces(layout: EngineLayout, plan: PlanSpec) -> list[int]:
    """Per stepped bucket (as :func:`_step_buffers` lists them), its largest piece: the engine hands
    the optimizer one tensor per parameter fragment of a bucket (``FlatBucket.split_master``), the
    largest over the ranks; stage 0 steps whole parameters."""
    if plan.stage == 0:
        return [max((math.prod(shape) for shape in shapes), default=0) for shapes in layout.bucket_shapes]
    pieces = layout.unit_bucket_pieces if plan.stage == 3 else layout.bucket_pieces
    ranks = layout.world_size
    return [max((max(rank, default=0) for rank in pieces[i:i + ranks]), default=0)
            for i in range(0, len(pieces), ranks)]


def _step_buffers(layout: EngineLayout, plan: PlanSpec, policy: Precision, optimizer: str,
                  implementation: str, g: int) -> dict[str, int]:
    """Temporaries of the optimizer step: fp32 master gradients and the optimizer's own.

    The engine steps torch's optimizers one flat bucket at a time ([Note: a bounded step] in
    shardengine/optim/bucketed_step.py): one bucket's fp32 gradient (none where the reduced
    gradient is fp32 already) and the temporaries over that bucket, a for-loop optimizer's over
    its largest piece; the largest bucket's being the peak. Other optimizers step every bucket at
    once. ``g``: bytes per element of the reduced gradient."""
    if plan.offload:
        return {}  # the step, its master gradients and temporaries live on the host
    state_dtype = FP32_MASTER_BYTES if policy.mixed else policy.state_bytes
    if plan.stage == 0 and not policy.mixed:  # the user's own optimizer over the original tensors
        return nonzero(optimizer_step_temporaries=step_temporary_bytes(
            optimizer, implementation, layout.replicated.trainable, layout.largest_param, state_dtype))
    if plan.stage == 0:
        stepped = [padded for padded, _ in layout.buckets]
    elif plan.stage == 3:
        stepped = list(layout.unit_bucket_shards)
    else:
        stepped = [shard for _, shard in layout.buckets]
    units = _largest_pieces(layout, plan) if optimizer in ELEMENTWISE else stepped
    buckets = list(zip(stepped, units))
    master = _master_grad_bytes(policy, g)
    calls = [[bucket] for bucket in buckets] if optimizer in STEPPED_BY_BUCKET else [buckets]

    def one_call(call: list[tuple[int, int]]) -> tuple[int, int]:
        numel = sum(n for n, _ in call)
        return master * numel, step_temporary_bytes(optimizer, implementation, numel,
                                                    max((unit for _, unit in call), default=0), state_dtype)

    master_grads, temporaries = max((one_call(call) for call in calls), key=sum, default=(0, 0))
    return nonzero(fp32_master_grads=master_grads, optimizer_step_temporaries=temporaries)


def engine_terms(layout: EngineLayout, plan: PlanSpec, precision: str, optimizer: str,
                 implementation: str = "plain", options: EngineOptions = EngineOptions()) -> EngineTerms:
    """Model states and the named buffers of each moment (see ``engines/base.py``)."""
    policy = precision_policy(precision)
    p, g = _bytes(policy, options.reduce_precision)
    states = engine_state_bytes(layout, plan, precision, optimizer, options.reduce_precision)
    late = _late_buffers(layout, plan, p, g, options)
    step = _step_buffers(layout, plan, policy, optimizer, implementation, g)
    if late > sum(step.values()):  # the end of backward, not the step, is the later peak
        step = nonzero(reductions_in_flight=late)
    return EngineTerms(states.params, states.grads, states.optimizer_states,
                       forward=nonzero(engine_buffers=_peak_buffers(layout, plan, p, g, options)),
                       step=step, **offloaded_terms(plan, states))


def in_backward_terms(layout: EngineLayout, plan: PlanSpec, precision: str, terms: EngineTerms,
                      options: EngineOptions = EngineOptions(), optimizer: str = "adamw",
                      implementation: str = "plain") -> EngineTerms:
    """``shard(step_in_backward=True)`` (shardengine/stages/in_backward.py): each bucket's
    reduced slice is stepped where it lands and freed, so the gradients held at the step (now
    inside backward) are the largest bucket's slice at stages 2-3, what ``memory_report()``
    reads when it lands; stage 1 still fills its full gradient buckets during backward. The
    step runs over capped runs of a bucket's pieces (:func:`_in_backward_step`); no gradient
    survives backward."""
    policy = precision_policy(precision)
    if plan.stage >= 2:
        g = _bytes(policy, options.reduce_precision)[1]
        shards = layout.unit_bucket_shards if plan.stage == 3 else [shard for _, shard in layout.buckets]
        terms = replace(terms, grads=g * max(shards, default=0))
    if optimizer in STEPPED_BY_BUCKET:
        p, g = _bytes(policy, options.reduce_precision)
        step = in_backward_step_bytes(layout, plan, policy, optimizer, implementation, g)
        late = _late_buffers(layout, plan, p, g, options)
        terms = replace(terms, step=step if sum(step.values()) >= late else nonzero(reductions_in_flight=late))
    return replace(terms, grads_transient=True)


def in_backward_step_bytes(layout: EngineLayout, plan: PlanSpec, policy: Precision, optimizer: str,
                           implementation: str, g: int) -> dict[str, int]:
    """The step inside backward's working set: the largest run of pieces stepped together
    ([Note: the step inside backward under a byte cap] in shardengine/optim/step_groups.py),
    its master-dtype gradient (a view where the reduced gradient is fp32 already, ``g`` = 4)
    and the optimizer's temporaries over it."""
    state_dtype = FP32_MASTER_BYTES if policy.mixed else policy.state_bytes  # the master's element
    master = _master_grad_bytes(policy, g)
    pieces = layout.unit_bucket_pieces if plan.stage == 3 else layout.bucket_pieces

    def one_run(numels: list[int]) -> tuple[int, int]:
        return master * sum(numels), step_temporary_bytes(optimizer, implementation, sum(numels), max(numels),
                                                          state_dtype)

    runs = ([numels[i] for i in run] for numels in pieces for run in step_runs(numels, state_dtype))
    master_grads, temporaries = max((one_run(run) for run in runs), key=sum, default=(0, 0))
    return nonzero(fp32_master_grads=master_grads, optimizer_step_temporaries=temporaries)


@dataclass(frozen=True)
class ExactShardEngineModel:
    """Exact engine accounting for one planned module, used by the plans when it applies.

    It applies only at the world size it was planned for; searches over other world
    sizes (the "what would fit" advice) fall back to the analytic ``ceil(Ψ/N)`` formulas.
    ``group_layout``: hybrid sharding's layout over ``options.shard_group_size`` ranks,
    which stages 1-3 use (stage 0 shards nothing and keeps ``layout``).
    ``stage2_layout`` / ``stage2_group_layout``: the same with stage 2's buckets, which end at
    units too (None: as ``layout``).
    """

    layout: EngineLayout
    options: EngineOptions
    group_layout: Optional[EngineLayout] = None
    stage2_layout: Optional[EngineLayout] = None
    stage2_group_layout: Optional[EngineLayout] = None

    def applies(self, world_size: int) -> bool:
        return world_size == self.layout.world_size

    def layout_for(self, plan: PlanSpec) -> EngineLayout:
        grouped = plan.stage > 0 and self.group_layout is not None
        if plan.stage == 2 and self.stage2_layout is not None:
            return self.stage2_group_layout if grouped else self.stage2_layout
        return self.group_layout if grouped else self.layout

    def states(self, plan: PlanSpec, precision: str, optimizer: str) -> ModelStateBytes:
        return engine_state_bytes(self.layout_for(plan), plan, precision, optimizer, self.options.reduce_precision)

    def terms(self, plan: PlanSpec, precision: str, optimizer: str, implementation: str,
              prefetch: int, in_backward: bool = False) -> EngineTerms:
        """``in_backward``: with ``shard(step_in_backward=True)``."""
        options = replace(self.options, prefetch=prefetch)
        terms = engine_terms(self.layout_for(plan), plan, precision, optimizer, implementation, options)
        if not in_backward:
            return terms
        return in_backward_terms(self.layout_for(plan), plan, precision, terms, options, optimizer, implementation)


def exact_engine_model(module: nn.Module, world_size: int, options: EngineOptions = EngineOptions(),
                group_of: Optional[dict[int, int]] = None) -> ExactShardEngineModel:
    """:func:`engine_layout` at ``world_size``, and over the shard group for hybrid sharding.

    >>> import torch
    >>> net = torch.nn.Linear(3, 5)                                       # 20 parameters
    >>> model = exact_engine_model(net, 4, EngineOptions(shard_group_size=2))
    >>> model.layout.replicated.shard, model.group_layout.replicated.shard
    (5, 10)
    """
    k = options.shard_group_size
    if k is not None and (k < 1 or world_size % k):
        raise EstimatorInputError(f"shard group size {k} must divide the world size {world_size}")
    hybrid = k not in (None, world_size)
    layout = engine_layout(module, world_size, options, group_of)
    group = engine_layout(module, k, options, group_of) if hybrid else None
    stage2 = engine_layout(module, world_size, options, group_of, cut_at_units=True)
    stage2_group = engine_layout(module, k, options, group_of, cut_at_units=True) if hybrid else None
    return ExactShardEngineModel(layout, options, group, stage2, stage2_group)
