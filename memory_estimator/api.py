"""``estimate``: the one entry point that turns a model and a setup into a verdict."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .basis import basis_note, memory_basis
from .hardware.calibration import calibrated_overheads
from .terms.checkpointing import check_checkpointing
from .hardware.devices import Device, resolve_device
from .engines.shardengine_exact import ExactShardEngineModel
from .engines import DeepSpeedKnobs, EngineMemoryModel, ShardEngine, make_engine
from .plan.capacity import Capacity, resolve_capacity
from .plan.drivers import Driver, plan_drivers
from .request import EngineRequest, EstimateRequest
from .errors import EstimatorInputError
from .terms.adapters import Adapters, check_targets, describe, frozen_numel
from .terms.finetune import check_in_backward
from .terms.kernels import check_loss
from .terms.kernel_families import kernel_set
from .allocator.lengths import run_lengths
from .model.facts import ActivationModel, model_facts
from .terms.optimizers import check_implementation, check_optimizer, optimizer_implementation, optimizer_name
from .terms.overheads import MODULE_LOADING, Overheads
from .plan.memory import (MemoryInputs, PlanEstimate, TrainingSetup, all_plans, largest_fitting, least_sharded_fit,
                          suggestions)
from .terms.precision import check_amp, check_precision, precision_policy
from .terms.proportions import RankShares, rank_shares
from .model.stats import ModelStats, check_count
from .byte_units import format_bytes

# Host RAM has no CUDA context, no NCCL and no caching allocator to fragment.
CPU_OVERHEADS = Overheads(cuda_context_bytes=0, fragmentation_fraction=0.0, nccl_bytes=0)

# Longest sequence / largest batch accepted before an input is taken for a typo.
MAX_SEQ_LEN = 1 << 24
MAX_MICRO_BATCH = 1 << 20
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class Estimate:
    """The answer: every plan term by term, the recommended plan and the largest micro-batch.

    ``to_json_dict()`` gives exactly the CLI's ``--json`` schema; the other fields
    (notes, suggestions) are for people and the engine.
    """

    params: int
    world_size: int
    device: Device
    plans: tuple[PlanEstimate, ...]
    recommended: str | None
    max_micro_batch: int | None
    activation_source: str              # "analytic", "traced" or "not estimated"
    stats: ModelStats
    setup: TrainingSetup
    overheads: Overheads
    notes: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    exact_engine: ExactShardEngineModel | None = None   # shardengine's exact accounting (module input)
    engine: str = "shardengine"
    model: ActivationModel | None = None  # the activation and logits functions behind the plans (for re-planning)
    shares: RankShares | None = None  # uneven data: the plans are for shares.worst_rank
    drivers: Mapping[str, tuple[Driver, ...]] = field(default_factory=dict)  # plan -> what moved it most
    engine_model: EngineMemoryModel | None = None  # the engine's memory model behind the plans (re-planning)
    capacity: Capacity = field(default_factory=Capacity)  # the node's host RAM and disk the plans were judged on
    shape_cache: Any = None  # varying lengths: the replayed allocator's excess (allocator/reserved.py)

    @property
    def memory_inputs(self) -> MemoryInputs:
        """What every plan of this answer was priced from (for re-pricing under a changed setup)."""
        return MemoryInputs(self.stats, self.setup, self.device, self.model, self.overheads,
                            self.engine_model or ShardEngine(), self.exact_engine, self.capacity,
                            shape_cache=self.shape_cache)

    @property
    def activations_estimated(self) -> bool:
        """Every part's activations are counted (False for a vision tower or an architecture not modelled)."""
        return self.activation_source != "not estimated" and not (self.model is not None and self.model.unmodelled)

    def plan(self, name: str) -> PlanEstimate:
        for plan in self.plans:
            if plan.name == name:
                return plan
        raise KeyError(f"{name!r} is not a plan of engine {self.engine} "
                       f"(its plans: {', '.join(p.name for p in self.plans)})")

    @property
    def recommended_plan(self) -> PlanEstimate | None:
        return None if self.recommended is None else self.plan(self.recommended)

    @property
    def warnings(self) -> tuple[str, ...]:
        """The notes that make a number incomplete (a term left out), as opposed to explaining one."""
        return tuple(note for note in self.notes if "not estimated" in note)

    def to_json_dict(self) -> dict[str, Any]:
        """The ``--json`` answer: every number and every assumption, note and warning of the table."""
        worst = {"worst_rank": self.shares.to_json_dict()} if self.shares is not None else {}
        setup = self.setup
        return {
            "params": self.params,
            "world_size": self.world_size,
            "device": {"name": self.device.name, "memory_bytes": self.device.memory_bytes,
                       "usable_bytes": int(self.device.memory_bytes * (1 - setup.safety_margin))},
            "plans": [{**plan.to_json_dict(), "drivers": [d.to_json_dict() for d in self.drivers.get(plan.name, ())]}
                      for plan in self.plans],
            "recommended": self.recommended,
            "max_micro_batch": self.max_micro_batch,
            "engine": self.engine,
            "precision": setup.policy.name,
            "setup": {"model_source": self.stats.source, "micro_batch": setup.micro_batch,
                      "seq_len": setup.seq_len, "checkpointing": setup.checkpointing,
                      "fused_attention": setup.fused_attention, "optimizer": setup.optimizer,
                      "optimizer_impl": setup.optimizer_impl, "amp": setup.amp,
                      "safety_margin": setup.safety_margin, "activations": self.activation_source,
                      "memory_basis": memory_basis(self)},
            "warnings": list(self.warnings),
            "notes": [note for note in self.notes if note not in self.warnings],
            "suggestions": list(self.suggestions),
            "capacity": self.capacity.to_json_dict(self.world_size),
            **worst,
        }


def _check_fraction(name: str, value: float, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < upper):
        raise EstimatorInputError(f"{name} must be a number in [0, {upper}), got {value!r}")
    return float(value)


def _validated_setup(setup: TrainingSetup) -> TrainingSetup:
    check_precision(setup.precision)
    check_amp(setup.amp)
    precision_policy(setup.precision, setup.amp)
    check_optimizer(setup.optimizer)
    check_implementation(setup.optimizer_impl)
    check_checkpointing(setup.checkpointing)
    check_count("world size", setup.world_size, maximum=MAX_WORLD_SIZE)
    check_count("micro-batch", setup.micro_batch, maximum=MAX_MICRO_BATCH)
    check_count("sequence length", setup.seq_len, maximum=MAX_SEQ_LEN)
    check_count("prefetch depth", setup.prefetch_depth, minimum=0, maximum=1024)
    check_count("bucket bytes", setup.bucket_bytes, minimum=0, maximum=1 << 40)
    _check_fraction("safety margin", setup.safety_margin, 1.0)
    if setup.module_loading not in MODULE_LOADING:
        raise EstimatorInputError(f"unknown CUDA module loading {setup.module_loading!r}; choose from lazy, eager")
    if setup.shard_numel_per_rank is not None:
        check_count("shard numel per rank", setup.shard_numel_per_rank)
    check_loss(setup.loss)
    check_count("gradient accumulation", setup.grad_accum, maximum=1 << 20)
    return setup


def _adapters(lora_rank, lora_targets, trainable_params, base_dtype, lora_dropout,
              quantizer="bitsandbytes") -> Adapters | None:
    """The frozen-base description, or None for full training (a base dtype alone is refused)."""
    if lora_rank is None and trainable_params is None:
        if base_dtype is not None or lora_targets is not None:
            raise EstimatorInputError("--base-dtype and --lora-targets describe a frozen base: give --lora-rank "
                                      "or --trainable-params too (full training updates every weight)")
        return None
    count = None if trainable_params is None else check_count("trainable params", trainable_params, minimum=0)
    rank = None if lora_rank is None else check_count("LoRA rank", lora_rank, maximum=1 << 20)
    return Adapters(lora_rank=rank, lora_targets=check_targets(lora_targets), trainable_params=count,
                    base_dtype=base_dtype, lora_dropout=float(lora_dropout), quantizer=quantizer)


def _validated_overheads(overheads: Overheads) -> Overheads:
    for name, value in (("CUDA context bytes", overheads.cuda_context_bytes), ("NCCL bytes", overheads.nccl_bytes)):
        if value is not None:
            check_count(name, value, minimum=0, maximum=1 << 40)
    _check_fraction("fragmentation fraction", overheads.fragmentation_fraction, 1.0)
    return overheads


def _notes(stats: ModelStats, model: ActivationModel, setup: TrainingSetup, plans, engine: EngineMemoryModel,
           exact: ExactShardEngineModel | None) -> tuple[str, ...]:
    notes = []
    if exact is not None and engine.name == "shardengine":
        notes.append("model states are shardengine's exact per-rank bytes (its bucket planner, padding included)")
    if model.source == "not estimated" and not model.unmodelled:
        notes.append("activations were not estimated: give --hidden/--layers/--heads/--vocab, a config or a module with example inputs")
    for part in model.unmodelled:
        notes.append(f"not estimated: {part}; the verdict holds unless they exceed the headroom, and no largest "
                     "micro-batch is claimed (--module with example inputs traces the whole model)")
    if stats.largest_unit is None and exact is None:
        notes.append("largest unit unknown: stage 3 assumes the whole model is gathered at once (give --largest-layer)")
    if model.source == "traced":
        notes.append("activations traced on fake tensors (nothing allocated), unit by unit: checkpointing and activation "
                     "offload apply to the engine's units; the fused-attention flag does not (the trace runs the "
                     "module's own attention)")
    if setup.optimizer == "adafactor" and stats.factored_state_numel == 0:
        notes.append("adafactor's factored state counted as 0 bytes (shapes unknown)")
    policy = setup.policy
    if policy.amp:
        base = None if setup.adapters is None else setup.adapters.base_dtype
        held = ("fp32 weights, gradients and optimizer state, a {0} copy of the weights" if base in (None, "fp32")
                else "fp32 adapters (weights, gradients, optimizer state) and a {0} copy of them (the "
                     f"{base} base is not cast)")
        notes.append(f"autocast {policy.amp}: {held.format(policy.amp)} while backward needs it, fp32 norms/softmax/loss")
    elif not policy.mixed:
        notes.append(f"{policy.name} training: no master copy; activations counted at {policy.activation_bytes} bytes")
    notes += _finetuning_notes(stats, setup, plans)
    at_step = [plan.name for plan in plans if plan.peak_moment == "step"]
    if at_step:
        notes.append(f"peak at the optimizer step for {', '.join(at_step)}: activations are freed by then, "
                     "the working set holds the step's buffers")
    return tuple(notes)


def _finetuning_notes(stats: ModelStats, setup: TrainingSetup, plans) -> list[str]:
    """What the fine-tuning flags changed, and the paged states the allocator does not see."""
    notes = []
    if setup.adapters is not None:
        trainable = setup.adapters.trainable(stats.architecture)
        notes.append(describe(setup.adapters, trainable, frozen_numel(stats, setup.adapters, trainable)))
    paged = max((plan.outside_allocator for plan in plans), default=0)
    if paged:
        notes.append(f"{setup.optimizer}: up to {format_bytes(paged)} of optimizer state per rank live in CUDA unified "
                     "memory outside torch's allocator: nvidia-smi shows them, torch.cuda.max_memory_allocated() "
                     "does not, and under pressure they page to host RAM (slower steps) instead of failing; the "
                     "verdict is judged without them")
    if setup.optimizer_in_backward:
        notes.append("optimizer in backward: each gradient is freed once its parameter steps (no gradient "
                     "clipping over all gradients, no accumulation)")
    if setup.grad_accum > 1:
        notes.append(f"gradient accumulation over {setup.grad_accum} micro-steps: gradients are held between them")
    return notes


def _resolve_precision(precision: str | None, amp: str | None, knobs: DeepSpeedKnobs | None) -> str:
    if precision is not None:
        return precision
    if amp is not None:
        return "fp32"
    if knobs is not None and knobs.precision is not None:
        return knobs.precision
    return "bf16"


def estimate(request: EstimateRequest | None = None, /, **keywords: Any) -> Estimate:
    """Will this model train on these accelerators, and with which plan?

    Ask with an :class:`~memory_estimator.request.EstimateRequest` (the model, its training,
    fine-tuning, engine and target as typed parts), with its flat keywords
    (``estimate(params=7e9, world_size=8)``, parsed by ``EstimateRequest.from_keywords``), or
    both: the keywords then change the request's fields.

    Give exactly one of ``params`` (a count, optionally with ``largest_layer`` and the
    architecture ``hidden/layers/heads/vocab`` for activations), ``config`` (a HF-style
    config.json path or dict) or ``module`` (an ``nn.Module``, a zero-argument factory,
    ``"pkg.mod:fn"`` or ``"path/to/file.py:fn"``; with ``example_inputs(micro_batch,
    seq_len)`` its activations are traced on fake tensors, allocating nothing).

    ``engine`` picks whose memory is modelled: ``"shardengine"`` (a live module is
    then planned with its own bucket planner, so the model-state terms equal its
    ``memory_report()``; ``engine_options`` carries ``shard()``'s options), ``"ddp"``,
    ``"fsdp2"`` (``reduce_dtype``) or ``"deepspeed"`` (``deepspeed_config``: a
    ds_config.json path or dict). ``precision`` is ``fp32``, ``bf16``/``fp16`` (fp32
    masters) or ``pure-bf16``/``pure-fp16``; ``amp="bf16"|"fp16"`` is torch autocast over
    fp32 weights. ``optimizer`` is a name or a live ``torch.optim`` instance;
    ``optimizer_impl`` ``foreach``/``fused``/``plain`` (default: torch's choice for the
    device). ``device="this-machine"`` reads free CUDA memory, or on CPU the RAM
    available to this rank, where the overheads default to zero. ``zero_grad_to_none=False``
    keeps gradients zeroed between steps instead of freeing them (torch < 2.0's
    default), so engines whose gradients are autograd's hold them beside the activations.
    ``proportions`` (one share per rank, uneven data): the global micro-batch
    ``micro_batch * world_size`` is split by them and the plans are for the rank with the
    largest share (``Estimate.shares`` says which, and every rank's micro-batch).
    ``calibration`` (a file written by ``python -m shardengine.selfcheck`` or ``memory-estimator
    calibrate``, or a ``Calibration``): on a GPU, the CUDA context and fragmentation it
    measured replace the published defaults unless ``overheads`` is given.

    Fine-tuning (``docs/estimator-finetuning.md``): ``lora_rank`` with ``lora_targets``
    (module names or ``attention``/``mlp``/``all-linear``; default every attention and MLP
    projection) or ``trainable_params`` train adapters on a frozen base stored in
    ``base_dtype`` (``bf16``/``fp16``/``int8``/``nf4``); ``loss`` ``plain``/``chunked``/``fused``
    cross-entropy, ``fused_norm``, ``compile`` say which kernels run; ``grad_accum``
    micro-steps hold gradients between them; ``optimizer_in_backward`` frees each gradient
    once its parameter steps; ``activation_offload`` moves saved activations to host RAM as
    forward saves them; ``quantizer`` ``bitsandbytes`` (its matmuls keep every projection's
    input) or ``torchao`` (torchtune's ``LinearNF4`` keeps only the weight). Each plan's ``drivers`` say which assumptions moved it most.

    >>> qlora = estimate(config="tests/configs/llama-2-7b.json", lora_rank=16, base_dtype="nf4",
    ...                  precision="pure-bf16", optimizer="paged-adamw8bit", checkpointing="full",
    ...                  seq_len=2048, device="RTX4090")
    >>> qlora.recommended, round(qlora.plan("ddp").params / 2**30, 1)
    ('ddp', 3.7)

    >>> result = estimate(params=7.5e9, world_size=64, precision="fp16", optimizer="adam",
    ...                   device_memory_bytes="80GB")
    >>> # zero3 holds 14Ψ/N, the ZeRO paper's 16Ψ/N less the fp16 shard it keeps beside the master
    >>> [round(p.params + p.grads + p.optimizer_states) / 1e9 for p in result.plans[:4]]
    [120.0, 31.40625, 16.640625, 1.640625]
    >>> result.recommended
    'zero1'
    """
    if request is not None and not isinstance(request, EstimateRequest):
        raise TypeError(f"estimate() takes an EstimateRequest or keywords, got {type(request).__name__}; "
                        "e.g. estimate(params=7e9) or estimate(EstimateRequest(ModelRequest(params=7e9)))")
    request = request or EstimateRequest()
    return _answer(request.replaced(**keywords) if keywords else request)


def _engine_and_target(request: EstimateRequest) -> tuple[EngineMemoryModel, Device]:
    engine = request.engine
    engine_model = make_engine(engine.name, deepspeed_config=engine.deepspeed_config,
                               reduce_dtype=engine.reduce_dtype, gradient_as_bucket_view=engine.gradient_as_bucket_view,
                               offload_params=engine.offload_params, offload_device_budget=engine.offload_device_budget,
                               disk=engine.disk)
    return engine_model, resolve_device(request.target.device, request.target.device_memory_bytes)


def _training_setup(request: EstimateRequest, engine_model: EngineMemoryModel, target: Device) -> TrainingSetup:
    """The validated setup the request describes, with the engine's and the device's defaults filled in."""
    training, engine = request.training, request.engine
    knobs = getattr(engine_model, "knobs", None)
    default_impl = "plain" if target.kind == "cpu" else "foreach"
    if knobs is not None and knobs.own_optimizer:
        default_impl = "fused"
    bucket_bytes, prefetch_depth, reshard = _gather_knobs(engine, engine_model.name)
    micro_batch = training.micro_batch
    if micro_batch is None:
        micro_batch = knobs.micro_batch if knobs is not None and knobs.micro_batch else 1
    tuning = request.fine_tuning
    families = kernel_set(training.kernels)
    return _validated_setup(TrainingSetup(
        world_size=training.world_size, precision=_resolve_precision(training.precision, training.amp, knobs),
        optimizer=optimizer_name(training.optimizer), micro_batch=micro_batch, seq_len=training.seq_len,
        checkpointing=training.checkpointing, fused_attention=bool(training.fused_attention),
        prefetch_depth=prefetch_depth, reshard_after_forward=reshard, bucket_bytes=bucket_bytes,
        safety_margin=request.target.safety_margin,
        shard_numel_per_rank=engine.shard_numel_per_rank, amp=training.amp,
        optimizer_impl=training.optimizer_impl or optimizer_implementation(training.optimizer, default_impl),
        module_loading=request.target.module_loading, zero_grad_to_none=bool(training.zero_grad_to_none),
        adapters=_adapters(tuning.lora_rank, tuning.lora_targets, tuning.trainable_params, tuning.base_dtype,
                           tuning.lora_dropout, tuning.quantizer),
        fused_norm=bool(training.fused_norm) or families.fused_norm, compile=bool(training.compile),
        loss=training.loss if training.loss != "plain" or families.loss is None else families.loss,
        mlp_kernel=families.mlp, fused_residual=families.fused_residual, kernel_families=families.families,
        logits_cast=None if families.logits_cast else False,   # the cast turns on transformers' version
        grad_accum=training.grad_accum, optimizer_in_backward=bool(training.optimizer_in_backward),
        activation_offload=bool(training.activation_offload), loss_upcast=_optional_flag(training.loss_upcast),
        lengths=run_lengths(training, micro_batch), expandable_segments=bool(training.expandable_segments)))


def _optional_flag(value) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise EstimatorInputError(f"loss_upcast must be True, False or None (not stated), got {value!r}")


def _gather_knobs(engine: EngineRequest, engine_name: str) -> tuple[int, int, bool]:
    """(bucket bytes, prefetch depth, reshard after forward): ``engine.options``' when given."""
    bucket_bytes, prefetch_depth, reshard = engine.bucket_bytes, engine.prefetch_depth, engine.reshard_after_forward
    if engine.options is not None:
        bucket_bytes, prefetch_depth = int(engine.options.bucket_mb * 2**20), engine.options.prefetch
        if not reshard and engine.options.reshard_after_forward:
            raise EstimatorInputError("reshard_after_forward=False contradicts engine_options, which reshards: "
                                      "give EngineOptions(reshard_after_forward=False) instead")
        reshard = engine.options.reshard_after_forward
    if not reshard and engine_name != "shardengine":
        raise EstimatorInputError(f"reshard_after_forward=False is shardengine's stage-3 option, not {engine_name}'s: "
                                  "for FSDP2's fully_shard(reshard_after_forward=False) read its zero2 plan")
    return bucket_bytes, prefetch_depth, bool(reshard)


def _target_overheads(request: EstimateRequest, target: Device) -> Overheads:
    overheads, calibration = request.target.overheads, request.target.calibration
    if overheads is None and calibration is not None and target.kind != "cpu":
        overheads = calibrated_overheads(calibration)
    return _validated_overheads(overheads or (CPU_OVERHEADS if target.kind == "cpu" else Overheads()))


def _answer(request: EstimateRequest) -> Estimate:
    """The estimate of one typed request: validate, gather the model's facts, price every plan."""
    engine_model, target = _engine_and_target(request)
    setup = _training_setup(request, engine_model, target)
    check_in_backward(setup, engine_model.name)
    shares = None
    if request.training.proportions is not None:
        shares = rank_shares(request.training.proportions, setup.world_size, setup.micro_batch)
        setup = _validated_setup(replace(setup, micro_batch=shares.worst_micro_batch))
    overheads = _target_overheads(request, target)
    stats, model, exact = model_facts(request.model, setup, request.engine.options, request.training.optimizer)

    capacity = resolve_capacity(request.target, target, setup.world_size)
    inputs = MemoryInputs(stats, setup, target, model, overheads, engine_model, exact, capacity,
                          shape_cache=_shape_cache(model, setup, target),
                          cast_shape_cache=_shape_cache(model, replace(setup, logits_cast=True), target)
                          if setup.logits_cast_unstated(model.architecture) else None)
    plans = all_plans(inputs)
    chosen = least_sharded_fit(plans)
    result = Estimate(
        params=stats.params, world_size=setup.world_size, device=target, plans=plans,
        recommended=chosen.name if chosen else None, max_micro_batch=_max_micro_batch(chosen, inputs),
        activation_source=model.source, stats=stats, setup=setup, overheads=overheads,
        notes=_notes(stats, model, setup, plans, engine_model, exact) + ((shares.note(),) if shares else ()),
        suggestions=() if chosen else suggestions(inputs),
        exact_engine=exact, engine=engine_model.name, model=model, shares=shares, engine_model=engine_model,
        drivers=_drivers(plans, inputs), capacity=capacity, shape_cache=inputs.shape_cache,
    )
    basis = basis_note(result)
    return replace(result, notes=result.notes + (basis,)) if basis else result


def _shape_cache(model: ActivationModel, setup: TrainingSetup, target: Device):
    """Varying lengths on a GPU: the caching allocator replayed over the run's batches (allocator/)."""
    if setup.lengths is None or target.kind == "cpu":
        return None
    shape = model.step_shape(setup.micro_batch, setup)
    if shape is None:
        return None
    from .allocator.reserved import shape_cache
    return shape_cache(shape, setup.lengths, setup.expandable_segments)


def _drivers(plans, inputs: MemoryInputs) -> dict[str, tuple[Driver, ...]]:
    """Each plan's costliest assumptions, by re-pricing it with one assumption changed."""
    from .terms.model_states import plan_spec
    from .plan.memory import plan_estimate

    out = {}
    for plan in plans:
        spec = plan_spec(plan.name)

        def total_with(changed, spec=spec):
            try:
                return plan_estimate(spec, inputs.with_setup(changed)).total
            except EstimatorInputError:
                return None
        out[plan.name] = plan_drivers(plan.total, total_with, inputs.setup, inputs.stats)
    return out


def _max_micro_batch(chosen, inputs: MemoryInputs) -> int | None:
    """Largest micro-batch that still fits the recommended plan; None without activations."""
    if chosen is None or inputs.model.source == "not estimated" or inputs.model.unmodelled:
        return None
    from .terms.model_states import plan_spec
    from .plan.memory import plan_fits_with

    spec, setup = plan_spec(chosen.name), inputs.setup
    fits = lambda b: plan_fits_with(spec, inputs.with_setup(replace(setup, micro_batch=b)))  # noqa: E731
    return largest_fitting(fits, setup.micro_batch, limit=MAX_MICRO_BATCH)
