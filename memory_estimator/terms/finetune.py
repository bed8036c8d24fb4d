"""Engine terms of fine-tuning runs: a frozen base beside trained adapters, the optimizer in
backward, paged optimizer states.

[Note: a frozen base is two models in one engine]
Every engine treats parameters that do not require grad as weights only: DDP buckets and
reduces the trainable ones, ZeRO/FSDP shard optimizer state and gradients of the
trainable ones, and at stage 3 shard (and gather) the frozen ones like the rest. So a
plan's terms are the engine's terms for the *trainable* model, plus the frozen weights
in their storage dtype (sharded at stage 3), and stage 3's gathered units are the full
model's units at the base's storage size. This holds for any engine model without
teaching each one about adapters.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from ..engines.base import EngineContext, EngineTerms, nonzero
from ..errors import EstimatorInputError
from .adapters import (BASE_DTYPES, dequantized_weight_bytes, frozen_numel, frozen_storage_bytes,
                       packed_bytes_per_element, quant_state_bytes)
from .model_states import PlanSpec
from ..model.stats import ModelStats

if TYPE_CHECKING:
    from ..engines import EngineMemoryModel
    from ..plan.setup import TrainingSetup

PAGED = ("paged-adamw8bit", "paged-adamw")
# Buffers that hold gathered parameters (they shrink with a quantized base); gradient
# buffers follow the trainable model.
_GATHERED = ("gathered_units", "all_gather_buffers", "gathered_parameters")


def trainable_stats(stats: ModelStats, trainable: int, block: int | None = None) -> ModelStats:
    """The trainable part as a model of its own (for the engine's state and step terms).

    Its units and blocks are the trainable share of the model's (``block``: the trainable
    parameters of one block when known exactly): FSDP2 reduce-scatters, and every engine
    buckets, only the gradients that exist, so a frozen block's weights size no gradient
    buffer."""
    share = trainable / stats.params if stats.params else 0.0

    def scaled(count: int | None, exact: int | None = None) -> int | None:
        if count is None:
            return None
        return min(trainable, max(math.ceil(count * share), exact or 0))

    return replace(stats, params=trainable,
                   largest_tensor=min(stats.largest_tensor or trainable, trainable),
                   largest_unit=scaled(stats.largest_unit, block),
                   block_params=None if stats.block_params is None else (
                       min(trainable, block) if block is not None else scaled(stats.block_params)),
                   factored_state_numel=math.ceil(stats.factored_state_numel * share))


def adapt_terms(plan: PlanSpec, stats: ModelStats, setup: "TrainingSetup", engine: "EngineMemoryModel",
                context: Callable[[ModelStats], EngineContext]) -> EngineTerms:
    """The engine's terms for trainable adapters on a frozen (maybe quantized) base."""
    adapters = setup.adapters
    trainable = adapters.trainable(stats.architecture)
    frozen = frozen_numel(stats, adapters, trainable)
    p = setup.policy.param_bytes
    train = engine.terms(plan, context(trainable_stats(stats, trainable, trainable_per_block(stats, adapters))))
    state = quant_state_bytes(stats, adapters, frozen)   # never sharded nor offloaded
    frozen_bytes = frozen_storage_bytes(stats, adapters, frozen, p) - state
    forward = dict(train.forward)
    # FSDP2 stores every parameter sharded, even when it keeps them gathered (its zero2 plan).
    if plan.shards_params or getattr(engine, "name", "") == "fsdp2":
        frozen_bytes = math.ceil(frozen_bytes / setup.world_size)
    full_terms = engine.terms(plan, context(stats))
    full = full_terms.forward
    if any(name in _GATHERED for name in full):
        stored = trainable * p + frozen_storage_bytes(stats, adapters, frozen, p) - state
        if adapters.quantized and stats.block_params and stats.architecture is not None:
            # the units as stored: quantized blocks, 16-bit embeddings and head (never quantized)
            gathered = engine.terms(plan, context(stored_stats(stats, adapters, trainable, stored, p))).forward
            forward.update({name: size for name, size in gathered.items() if name in _GATHERED})
        else:
            ratio = stored / (stats.params * p) if stats.params else 1.0
            forward.update({name: math.ceil(size * ratio) for name, size in full.items() if name in _GATHERED})
    forward.update(nonzero(dequantized_weight=dequantized_weight_bytes(stats, adapters, p)))
    host = dict(train.host)
    params = train.params + frozen_bytes + state
    if plan.offload_params:
        host["params"] = host.get("params", 0) + frozen_bytes
        params = train.params + state
    # the head's fetch copies a partition of the whole model's head, frozen and never quantized
    return replace(train, params=params, forward=forward, host=host, before_logits=full_terms.before_logits)


def autocast_cast_numel(stats: ModelStats, setup: "TrainingSetup") -> int:
    """The weights autocast casts to its low precision in forward (and keeps for backward).

    [Note: autocast over a frozen base]
    Autocast casts only fp32 tensors (``cached_cast`` skips an argument already in the
    target dtype), so a 16-bit or quantized frozen base costs no copy: only the fp32
    adapters are cast, and being leaves that require grad their casts are cached for the
    whole forward. This is how PEFT trains LoRA on a bf16 base under HF Trainer's
    ``--bf16``: PEFT <= 0.6 leaves the adapters in the fp32 ``nn.Linear`` draws them in
    (``_replace_module`` moves them to the base's device only), and PEFT >= 0.12 upcasts
    16-bit adapters to fp32 (``autocast_adapter_dtype=True``, peft#1706): state that as
    ``precision="fp32", amp="bf16", base_dtype="bf16"``. A frozen base stored in fp32 is
    cast op by op, and each matmul keeps its cast for backward: counted whole (an upper
    bound under checkpointing, which drops a block's casts until its recompute)."""
    adapters = setup.adapters
    if adapters is None or not setup.policy.amp:
        return stats.params if setup.policy.amp else 0
    trainable = adapters.trainable(stats.architecture)
    base_bytes = BASE_DTYPES[adapters.base_dtype] if adapters.base_dtype else setup.policy.param_bytes
    return trainable + (frozen_numel(stats, adapters, trainable) if base_bytes == 4 else 0)


# peft draws adapters in fp32 whatever the base's dtype; they exist whole on every rank until
# shard() has split them.
_ADAPTER_INIT_BYTES = 4
# A quantized base is quantized from the 16-bit checkpoint (bf16, as Hugging Face publishes them).
_QUANTIZED_SOURCE_BYTES = 2


def load_host_peak_bytes(plan: PlanSpec, stats: ModelStats, setup: "TrainingSetup") -> int:
    """Host bytes a rank holds while the frozen base loads, before the first step.

    [Note: the load-time host peak]
    At stage 3 the base is built on the meta device and streamed in (``se.shard`` then
    ``se.load_pretrained``): a rank holds its shard of the base in its storage dtype, the
    adapters as peft drew them, and at most two units in the checkpoint's dtype (the one
    being initialized or read, and the one whose shard is being kept; a quantized unit
    is quantized from it). Other plans load the base with ``from_pretrained`` on every
    rank: the whole base. A fixed overhead (the interpreter, torch, the process group)
    comes on top; ``benchmarks/bench_finetune_load.py`` measures it."""
    adapters = setup.adapters
    if adapters is None:
        return 0
    p = setup.policy.param_bytes
    trainable = adapters.trainable(stats.architecture)
    frozen = frozen_numel(stats, adapters, trainable)   # LoRA's base streams in whole
    stored = frozen_storage_bytes(stats, adapters, frozen, p)
    drawn = _ADAPTER_INIT_BYTES * trainable
    if not plan.shards_params:
        return stored + drawn
    source = (_QUANTIZED_SOURCE_BYTES if adapters.quantized
              else BASE_DTYPES[adapters.base_dtype] if adapters.base_dtype else p)
    unit = stats.largest_unit or stats.params
    return math.ceil(stored / setup.world_size) + drawn + math.ceil(2 * unit * source)


def in_backward_terms(plan: PlanSpec, stats: ModelStats, setup: "TrainingSetup", terms: EngineTerms) -> EngineTerms:
    """``--optimizer-in-backward`` (torchtune's ``optimizer_in_bwd``, torch's
    ``_apply_optimizer_in_backward``): each parameter steps in a hook as soon as its
    gradient is ready and the gradient is freed, so at most one parameter's gradient
    (and its step temporaries) exists at a time and nothing waits for a separate step."""
    g = setup.policy.grad_bytes
    largest = stats.largest_tensor or stats.params
    if setup.adapters is not None:
        largest = min(largest, setup.adapters.trainable(stats.architecture))
    one = g * (math.ceil(largest / setup.world_size) if plan.shards_grads else largest)
    step = {name: size for name, size in terms.step.items()
            if name not in ("fp32_master_grads", "optimizer_step_temporaries", "reductions_in_flight")}
    # freed as soon as they step: none survives into the next forward
    return replace(terms, grads=min(terms.grads, one), grads_transient=True, step=step)


def check_in_backward(setup: "TrainingSetup", engine_name: str) -> None:
    if not setup.optimizer_in_backward:
        return
    if setup.grad_accum > 1:
        raise EstimatorInputError("--optimizer-in-backward steps every micro-batch, so gradients cannot accumulate; "
                                  "use --grad-accum 1 (torchtune refuses the combination too)")
    if engine_name == "shardengine" and setup.precision == "fp16":
        raise EstimatorInputError("shardengine's step_in_backward refuses fp16 loss scaling (an overflow would "
                                  "skip a step already taken); use --precision bf16")
    if engine_name == "deepspeed":
        raise EstimatorInputError("DeepSpeed's ZeRO optimizer reduces gradients into its partitions and steps "
                                  "after backward (engine.step()); --optimizer-in-backward is modelled for "
                                  "--engine ddp or fsdp2")


def outside_allocator_bytes(optimizer: str, optimizer_states: int, share: float = 1.0) -> int:
    """bitsandbytes' paged optimizers keep their state in CUDA unified memory
    (``cudaMallocManaged``): nvidia-smi counts it, torch's allocator does not, and under
    pressure the driver pages it out to host RAM instead of failing. ``share``: the part of
    the stepped elements whose state is paged (:func:`paged_share`)."""
    return math.floor(optimizer_states * share) if optimizer in PAGED else 0


def stored_stats(stats: ModelStats, adapters, trainable: int, stored: int, p: int) -> ModelStats:
    """The model counted in ``p``-byte elements of what it stores: a quantized block weighs its
    quantized linears at the base dtype, its norms and adapters at ``p`` bytes; the embeddings,
    the head and so the largest tensor (never quantized) count whole. Gathered-unit buffers sized
    from these are the bytes a unit's gather really moves.

    [Note: a quantized block is gathered at its storage size, the root at 16 bits]
    Scaling every gathered buffer by the model's average storage ratio under-counts the root
    (embeddings and head, bitsandbytes leaves them 16-bit, often the largest unit) and
    over-counts the blocks."""
    arch = stats.architecture
    norms = arch.norms_per_layer * arch.hidden
    adapters_in_block = trainable_per_block(stats, adapters) or 0
    quantized = max(0, stats.block_params - norms)   # the adapters come beside the base's linears
    block = math.ceil(quantized * packed_bytes_per_element(adapters) / p) + norms + adapters_in_block
    ratio = block / stats.block_params
    return replace(stats, params=math.ceil(stored / p), block_params=block,
                   largest_unit=None if stats.largest_unit is None else max(
                       math.ceil(stats.largest_unit * ratio), min(stats.largest_unit, stats.outside_params or 0)))


def trainable_per_block(stats: ModelStats, adapters) -> int | None:
    """LoRA parameters of the largest block (MoE or dense), None when the split is unknown."""
    arch = stats.architecture
    if adapters.lora_rank is None or arch is None:
        return None
    from .adapters import linear_shapes

    per_layer = [sum(adapters.lora_rank * (i + o) * n for name, (i, o, n) in linear_shapes(arch, moe).items()
                     if name in adapters.lora_targets)
                 for moe, count in ((True, arch.moe_layer_count), (False, arch.layers - arch.moe_layer_count))
                 if count]
    return max(per_layer, default=None)


# bitsandbytes pages a state only for tensors of at least this many elements
# (``Optimizer8bit.get_state_buffer``: ``p.numel() < 1e5`` -> ``torch.zeros_like``).
PAGED_MIN_NUMEL = 100_000


def paged_share(stats: ModelStats, setup: "TrainingSetup") -> float:
    """The share of the trained elements whose optimizer state bitsandbytes pages.

    Smaller tensors get ordinary device tensors from torch's allocator: a LoRA rank-16
    adapter on a 4096-wide projection (16 x 4096 = 65,536 elements) is not paged. Known
    exactly for LoRA on known shapes (whole tensors, as one rank's optimizer sees them
    without sharding); full training and given counts are dominated by the large matrices
    and counted as paged."""
    adapters, arch = setup.adapters, stats.architecture
    if adapters is None or adapters.lora_rank is None or arch is None:
        return 1.0
    from .adapters import linear_shapes

    r, paged, total = adapters.lora_rank, 0, 0
    for moe, count in ((True, arch.moe_layer_count), (False, arch.layers - arch.moe_layer_count)):
        for name, (i, o, n) in linear_shapes(arch, moe).items():
            if name in adapters.lora_targets:
                for numel in (r * i, o * r):
                    total += count * n * numel
                    paged += count * n * numel if numel >= PAGED_MIN_NUMEL else 0
    if "lm_head" in adapters.lora_targets and arch.lm_head:
        for numel in (r * arch.hidden, arch.vocab * r):
            total += numel
            paged += numel if numel >= PAGED_MIN_NUMEL else 0
    return paged / total if total else 1.0
