"""The time model applied to a memory estimate: each plan's time per step, and the objective's pick.

The library API of step time: :func:`time_estimate` prices every plan of an ``Estimate``
(plus the hybrid-sharding plans when the cluster has several nodes) on the cluster a
:class:`TimingRequest` describes; ``plan.fastest`` searches it for the fastest plan that
fits. The CLI's time-model flags (``cli/timing_flags.py``) only build a ``TimingRequest``.

>>> from memory_estimator import estimate
>>> result = estimate(params=7e9, hidden=4096, layers=32, heads=32, vocab=32000, world_size=16,
...                   seq_len=4096, device="H100-80GB")
>>> timed = time_estimate(result, TimingRequest(nodes=2, gpus_per_node=8, objective="fastest"))
>>> [plan.name for plan in timed.plans][-3:], timed.recommended in {p.name for p in timed.plans if p.fits}
(['zero1-hsdp8', 'zero2-hsdp8', 'zero3-hsdp8'], True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from shardengine.engine_facts import Compression

from ..errors import EstimatorInputError
from ..hardware.calibration import Calibration, load_calibration
from ..hardware.interconnects import THIS_MACHINE, default_intra_node, resolve_link
from ..hardware.rates import device_rates
from ..terms.model_states import plan_spec
from ..timing.collectives import ALGORITHMS
from ..timing.step import Cluster, StepTime, TimedPlan, Workload, hybrid_plans, step_time
from .memory import PlanEstimate, plan_estimate

__all__ = ["TimingRequest", "TimedEstimate", "time_estimate", "workload_from_estimate", "OBJECTIVES",
           "DEFAULT_INTERCONNECT"]

OBJECTIVES = ("least-sharded", "fastest")
DEFAULT_INTERCONNECT = "ib-ndr"


@dataclass(frozen=True)
class TimingRequest:
    """The cluster a run's step is timed on, and what to recommend.

    ``nodes x gpus_per_node`` is the estimate's world size. Links: ``intra_node`` (default the
    device's usual one, e.g. nvlink4 for H100) and ``interconnect`` between nodes (default
    ib-ndr), catalog names, stated rates (``200GB/s``, ``400Gb/s/node``, ``hardware/link_rates.py``)
    or ``this-machine`` (then ``calibration``, a file, else the stored one, says what they
    measure); ``p2p`` False stages intra-node traffic through host memory. ``compute_efficiency`` None: each operation at its kernel's published rate (timing/operations.py), else every FLOP at peak x this;
    ``peak_tflops`` for devices not in the catalog; ``tf32`` runs fp32 matmuls on tensor cores.
    ``shard_group_size`` None tries hybrid groups of 1, 2, 4 ... nodes. ``objective``
    least-sharded (the memory answer's pick) or fastest. ``node_size_note`` says what was
    assumed of the nodes when only a world size was given (carried into the answer).
    """

    nodes: int
    gpus_per_node: int
    interconnect: Optional[str] = None
    intra_node: Optional[str] = None
    compute_efficiency: Optional[float] = None
    peak_tflops: Optional[float] = None
    tf32: bool = False
    p2p: bool = True
    grad_accum: int = 1
    shard_group_size: Optional[int] = None
    collective_algorithm: str = "auto"
    compression: Optional[Compression] = None
    objective: str = "least-sharded"
    calibration: Optional[str | Path] = None
    node_size_note: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimatorInputError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.objective not in OBJECTIVES:
            raise EstimatorInputError(f"unknown objective {self.objective!r}; choose from {', '.join(OBJECTIVES)}")
        if self.collective_algorithm not in ALGORITHMS:
            raise EstimatorInputError(f"unknown collective algorithm {self.collective_algorithm!r}; choose from "
                                      f"{', '.join(ALGORITHMS)}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class TimedEstimate:
    """Step times of every plan (hybrid ones with their own memory), and the objective's pick."""

    cluster: Cluster
    workload: Workload
    objective: str
    plans: tuple[PlanEstimate, ...]            # the memory estimate's plans, then the hybrid ones
    times: tuple[StepTime, ...]                # same order
    group_sizes: tuple[int, ...]
    recommended: Optional[str]
    least_sharded: Optional[str]
    node_size_note: Optional[str] = None       # what was assumed of the nodes (--gpus alone)


def _timed_plan(plan: PlanEstimate) -> TimedPlan:
    """What the time model needs of a memory plan: where it steps and which shards cross PCIe."""
    spec = plan_spec(plan.name)
    share = 1.0
    if spec.partial_params:  # a budget's share: the model states it moved of all it holds
        moved = plan.host_params + plan.host_grads + plan.host_optimizer_states
        held = moved + plan.params + plan.grads + plan.optimizer_states
        share = spec.params_fraction if spec.params_fraction is not None else (moved / held if held else 0.0)
    return TimedPlan(plan.name, plan.stage, plan.offload, disk=spec.disk,
                     params_on_host=spec.offload_params or spec.partial_params, host_share=share)


def time_estimate(result, request: TimingRequest) -> TimedEstimate:
    """Every plan of the memory estimate ``result`` (and the hybrid plans) timed on ``request``'s cluster."""
    if request.world_size != result.world_size:
        raise EstimatorInputError(f"the cluster ({request.nodes} nodes x {request.gpus_per_node} GPUs) is not the "
                                  f"estimate's world size {result.world_size}; estimate with world_size="
                                  f"{request.world_size}")
    if request.objective == "fastest":  # [Note: the planner and the recommended line see the same plans]
        from .candidates import with_candidate_plans

        result = with_candidate_plans(result)
    calibration = _calibration_if_needed(request, _rates_name(result.device))
    cluster = _cluster(request, result, calibration)
    workload = replace(workload_from_estimate(result, request.grad_accum), compression=request.compression)
    stage2 = replace(workload_from_estimate(result, request.grad_accum, stage=2), compression=request.compression)
    _check_compression(request.compression, workload)
    hybrid = _hybrid_choices(result, cluster, request.shard_group_size)
    plans = result.plans + tuple(memory for _, memory in hybrid)
    timed = [_timed_plan(p) for p in result.plans] + [plan for plan, _ in hybrid]
    times = tuple(step_time(plan, stage2 if plan.stage == 2 else workload, cluster) for plan in timed)
    if result.shares is not None:  # the worst rank sets the pace; the step covers the global batch
        tokens = result.shares.global_batch * result.setup.seq_len * workload.grad_accum
        times = tuple(replace(t, tokens_per_step=tokens) for t in times)
    sizes = tuple(plan.shard_group_size or cluster.world_size for plan in timed)
    fitting = [(t.step_s, p.name) for p, t in zip(plans, times) if p.fits]
    fastest = min(fitting)[1] if fitting else None
    chosen = fastest if request.objective == "fastest" else result.recommended
    return TimedEstimate(cluster, workload, request.objective, plans, times, sizes, chosen, result.recommended,
                         request.node_size_note)


def _check_compression(compression: Optional["Compression"], workload: Workload) -> None:
    """What the engine refuses whatever the plan: a low-precision wire no narrower than the gradients."""
    if compression is None:
        return
    wire = {"bf16": 2, "fp16": 2}.get(compression.grads)
    if wire is not None and workload.param_bytes <= wire:
        raise EstimatorInputError(f"--compression {compression.grads} with {workload.precision} gradients sends "
                                  "nothing less (the engine refuses it); use int8, or fp32 gradients")


def _calibration_if_needed(request: TimingRequest, device_name: str) -> Optional[Calibration]:
    names = (request.interconnect, request.intra_node, device_name)
    path = request.calibration  # a file, else the stored one
    return load_calibration(path and Path(path)) if any(name and name.startswith(THIS_MACHINE)
                                                        for name in names) else None


def _rates_name(device) -> str:
    """Whose rates price the step: a CPU device is this machine (there is no catalog of CPUs)."""
    return THIS_MACHINE if device.kind == "cpu" else device.name


def _cluster(request: TimingRequest, result, calibration) -> Cluster:
    device = device_rates(_rates_name(result.device), calibration, request.peak_tflops)
    if request.tf32:
        from ..hardware.rates import with_tf32

        device = with_tf32(device)
    intra = resolve_link(request.intra_node or default_intra_node(_rates_name(result.device)), calibration, "intra",
                         request.gpus_per_node)
    inter = resolve_link(request.interconnect or DEFAULT_INTERCONNECT, calibration, "inter", request.gpus_per_node)
    if not request.p2p:
        from ..hardware.link_rates import host_staged

        intra = host_staged(intra)
    return Cluster(request.nodes, request.gpus_per_node, intra, inter, device, request.compute_efficiency,
                   request.collective_algorithm, model_params=result.stats.params,
                   micro_tokens=result.setup.micro_batch * result.setup.seq_len)


def workload_from_estimate(result, grad_accum: int = 1, stage: int = 0) -> Workload:
    """The model's buckets and units: the engine's exact layout for a module, else from Ψ.
    ``stage`` 2: its buckets, which also end where a unit ends (the engine's flat/plan.py)."""
    setup, stats = result.setup, result.stats
    arch = stats.shape
    param_bytes = 4 if setup.precision == "fp32" else 2
    grad_tensors, buffer_groups, shapes = 0, (), ()
    trainable = setup.adapters.trainable(arch) if setup.adapters is not None else None
    trained = stats.params if trainable is None else max(1, trainable)
    if result.exact_engine is not None and result.exact_engine.applies(setup.world_size):
        engine = result.exact_engine
        layout = engine.stage2_layout if stage == 2 and engine.stage2_layout is not None else engine.layout
        buckets = tuple(padded for padded, _ in layout.buckets)
        units = tuple((unit[0], unit[1]) for unit in layout.units)
        grad_tensors, buffer_groups, shapes = layout.grad_tensors, layout.buffer_groups, layout.bucket_shapes
    else:
        per_bucket = max(1, setup.bucket_bytes // param_bytes)
        buckets = _split(trained, per_bucket)
        share = trained / stats.params
        units = tuple((u, math.ceil(u * share)) for u in _split(stats.params, stats.largest_unit or stats.params))
    return Workload(stats.params, setup.micro_batch * setup.seq_len, buckets, units,
                    layers=arch.layers if arch else None, hidden=arch.hidden if arch else None,
                    seq_len=setup.seq_len, precision=setup.precision, optimizer=setup.optimizer,
                    checkpointing=setup.checkpointing, grad_accum=grad_accum, prefetch=setup.prefetch_depth,
                    reshard_after_forward=setup.reshard_after_forward,
                    grad_tensors=grad_tensors, buffer_groups=buffer_groups, bucket_shapes=shapes,
                    trainable=trainable, newton_schulz_flops=_muon_flops(setup, stats),
                    outside_params=min(stats.outside_params or 0, stats.params),
                    offloaded_activations=_offloaded_activations(result, len(units)), **kernel_facts(setup, stats))


def _offloaded_activations(result, units: int) -> tuple[int, ...]:
    """Activation offload: the bytes each unit's activations cross the host link per micro-step
    (what the plan keeps on the host, spread over the layers, else the units)."""
    setup, model = result.setup, result.model
    if not setup.activation_offload or model is None:
        return ()
    host = model.activations(setup.micro_batch, setup).host
    arch = result.stats.shape
    pieces = max(1, arch.layers if arch is not None else units - 1)
    return (host // pieces,) * pieces if host else ()


def _muon_flops(setup, stats) -> float:
    """Newton-Schulz FLOPs of every hidden matrix (embeddings and head step with AdamW)."""
    if setup.optimizer not in ("muon", "muon-adamw"):
        return 0.0
    from ..terms.adapters import linear_shapes
    from ..terms.optimizers import newton_schulz_flops

    arch = stats.architecture
    if arch is None:  # shapes unknown: square matrices of the largest tensor's size
        side = math.isqrt(stats.largest_tensor or stats.params)
        return newton_schulz_flops([(side, side, max(1, stats.params // max(1, side * side)))])
    shapes = []
    for moe, count in ((True, arch.moe_layer_count), (False, arch.layers - arch.moe_layer_count)):
        shapes += [(i, o, n * count) for i, o, n in linear_shapes(arch, moe).values() if count]
    return newton_schulz_flops(shapes)


def _split(total: int, piece: int) -> tuple[int, ...]:
    """``total`` in pieces of ``piece``, the remainder last (the root unit, the last bucket)."""
    whole, rest = divmod(total, piece)
    return (piece,) * whole + ((rest,) if rest else ())


def _hybrid_choices(result, cluster: Cluster, group_size: Optional[int]) -> list[tuple[TimedPlan, PlanEstimate]]:
    """Hybrid plans with their memory, at the stages the engine shards within groups
    (``hybrid_stages``: DDP none, DeepSpeed 3, FSDP2 2-3). Without an explicit group size, per
    stage the smallest group that fits among a node, two nodes, four ... (smaller groups send
    less across nodes), else the one-node group."""
    stages = result.memory_inputs.engine.hybrid_stages
    if group_size is not None:
        return [(plan, _hybrid_memory(result, plan)) for plan in hybrid_plans(cluster, group_size)
                if plan.stage in stages]
    sizes, k = [], cluster.gpus_per_node
    while k < cluster.world_size and cluster.world_size % k == 0:
        sizes.append(k)
        k *= 2
    chosen = []
    for stage in stages:
        candidates = [hybrid_plans(cluster, k)[stage - 1] for k in sizes]
        estimates = [(plan, _hybrid_memory(result, plan)) for plan in candidates]
        chosen += [next((pair for pair in estimates if pair[1].fits), estimates[0])] if estimates else []
    return chosen


def _hybrid_memory(result, plan: TimedPlan) -> PlanEstimate:
    """Memory of a hybrid plan: the formulas with N -> the group size (the analytic path)."""
    setup = replace(result.setup, world_size=plan.shard_group_size, shard_numel_per_rank=None)
    estimate = plan_estimate(plan_spec(f"zero{plan.stage}"), result.memory_inputs.analytic().with_setup(setup))
    return replace(estimate, name=plan.name)


def kernel_facts(setup, stats) -> dict[str, Any]:
    """The Workload fields of the kernels around the matmuls: autocast's dtype, a quantized
    base's weights, compile and fused norms, the shapes their traffic scales with."""
    from ..terms.adapters import BASE_DTYPES

    arch, adapters = stats.shape, setup.adapters
    facts: dict[str, Any] = dict(compute_dtype=setup.amp, compile=setup.compile, fused_norm=setup.fused_norm,
                                 loss=setup.loss, fused_mlp=setup.mlp_kernel != "eager",
                                 fused_residual=setup.fused_residual)
    if arch is not None:
        facts.update(mlp_width=arch.width, gated_mlp=arch.gated_mlp, norms_per_layer=arch.norms_per_layer,
                     norm=arch.norm, dropout=arch.dropout, kv_width=arch.kv * arch.dim,
                     vocab=arch.vocab if arch.lm_head else None,
                     logits_cast=setup.logits_cast_bytes(arch))
    if adapters is not None and adapters.lora_rank and arch is not None:
        from ..timing.adapter_shapes import adapted_widths

        facts.update(lora_rank=adapters.lora_rank, lora_dropout=adapters.lora_dropout,
                     **adapted_widths(arch, adapters))
    if adapters is not None and adapters.quantized:
        per_element = BASE_DTYPES[adapters.base_dtype]
        facts.update(quantized_numel=_quantized_numel(stats, adapters, per_element), quantized_bytes=per_element)
    return facts


def _quantized_numel(stats, adapters, per_element: float) -> int:
    """The blocks' linear weights (what bitsandbytes and torchao quantize); without the shapes,
    the frozen base less what ``frozen_storage_bytes`` keeps in 16 bits."""
    from ..terms.adapters import frozen_numel, frozen_storage_bytes, linear_shapes

    arch = stats.architecture
    if arch is not None:
        return sum(count * i * o * n for moe, count in ((True, arch.moe_layer_count),
                                                        (False, arch.layers - arch.moe_layer_count))
                   for i, o, n in linear_shapes(arch, moe).values())
    frozen = frozen_numel(stats, adapters, adapters.trainable(arch))
    sixteen_bit = frozen_storage_bytes(stats, adapters, frozen, 2) - frozen * per_element
    return max(0, round(frozen - sixteen_bit / (2 - per_element)))


def tf32_note(timed: "TimedEstimate", request: TimingRequest) -> Optional[str]:
    """fp32 matmuls on a generation with TF32, timed at the plain FP32 rate because ``--tf32`` was not given."""
    from ..hardware.rates import TF32_GENERATIONS

    device = timed.cluster.device
    if request.tf32 or timed.workload.compute_precision != "fp32" or device.generation not in TF32_GENERATIONS:
        return None
    ratio = device.peak_flops_16bit / 2 / device.peak_flops_fp32
    return (f"fp32 matmuls are timed at {device.name}'s plain FP32 rate; with TF32 (--tf32: "
            f"torch.backends.cuda.matmul.allow_tf32 = True, Hugging Face's tf32=True) they run {ratio:.1f}x faster")

