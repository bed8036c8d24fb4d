"""DeepSpeed ZeRO stages 0-3, optimizer offload and parameter offload, with its bucket knobs.

Knob defaults are DeepSpeed's (``deepspeed/runtime/zero/config.py``); a
``ds_config.json`` overrides them (``DeepSpeedKnobs.from_config``).

- Precision: with ``fp16``/``bf16`` enabled DeepSpeed keeps 16-bit weights and gradients
  and fp32 master partitions with fp32 optimizer state; without, plain fp32. There is
  no pure low-precision mode (a pure-bf16 request is refused with that reason).
- Stages 0-1 keep the full 16-bit ``param.grad``; stage 2 keeps only this rank's
  gradient partition (``grads_in_partition``) and stage 3 its partition buffer, all
  persistent once allocated.
- Stages 1-2 allocate, at each ``backward()``, ``reduce_bucket_size`` elements of
  contiguous-gradient buffer, twice when ``overlap_comm`` double-buffers it
  (``stage_1_and_2.py``, ``ipg_buffer``). Hugging Face's and DeepSpeed's docs put the
  whole footprint of ``overlap_comm`` at "4.5x the allgather_bucket_size and
  reduce_bucket_size values"; the buffers this model counts are the ones the source
  allocates.
- At the step, each parameter group's (stage 3: each ``sub_group_size`` sub-group's)
  16-bit gradient partition is flattened and cast to fp32 for the optimizer
  (``single_grad_partition`` in ``stage_1_and_2.py``;
  ``_prepare_fp32_grad_for_sub_group`` in ``stage3.py``): 2 + 4 bytes per element of
  that group, briefly.
- Stage 3 gathers parameters module by module: the running module plus up to
  ``stage3_prefetch_bucket_size`` elements fetched ahead, never more than
  ``stage3_max_live_parameters``, and keeps those it reuses within
  ``stage3_max_reuse_distance`` elements (``partitioned_param_coordinator.py``); its gradient
  reduction uses one persistent ``reduce_bucket_size`` flat buffer (``__ipg_bucket_flat_buffer``).
- The step's flat buffers stay in the allocator's cache beside the next forward
  (``[Note: DeepSpeed's step buffers in the cache]``): reserved and nvidia-smi count them.
- ``offload_optimizer`` (ZeRO-Offload: ``zero2-offload``, ``zero3-offload``) moves fp32
  masters, optimizer states and the gradient partitions (as fp32) to the host and steps
  there; ``offload_param`` (stage 3) moves the 16-bit parameter partitions too
  (ZeRO-Infinity): the device keeps the gathered working set and the buckets.
- Stage 3 with a model built under ``zero.Init`` (Hugging Face's and accelerate's way,
  ``zero3_init_flag``) swaps ``torch.nn.functional.linear`` for ``zero3_linear_wrap`` for
  good (``memory_efficient_linear``, default on): see ``[Note: DeepSpeed's linear keeps its
  input]`` at :meth:`DeepSpeedZero.keeps_linear_inputs`.
- ``device: "nvme"`` (ZeRO-Infinity's NVMe tier, the ``-disk`` plans, planned on request):
  see ``[Note: DeepSpeed's NVMe tier]`` below; the device holds what the ``cpu`` plans hold.
- DeepSpeed's own optimizers (``"optimizer"`` in the config: FusedAdam, CPUAdam) are
  fused kernels, no temporaries; a client torch optimizer keeps its implementation's.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from ..errors import EstimatorInputError
from ..terms.model_states import PlanSpec, plan_spec
from ..terms.optimizers import step_temporary_bytes
from ..terms.precision import FP32_BYTES
from .base import EngineContext, EngineTerms, nonzero


@dataclass(frozen=True)
class DeepSpeedKnobs:
    """The ``zero_optimization`` settings that change bytes, with DeepSpeed's defaults."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None           # DeepSpeed: True at stage 3, else False
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000     # stage3_prefetch_bucket_size
    max_live_parameters: int = 1_000_000_000   # stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000    # stage3_max_reuse_distance
    param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    memory_efficient_linear: bool = True       # zero.Init's F.linear override (zero_optimization key)
    stage: int | None = None                   # what the config asks for (reported, not forced)
    precision: str | None = None               # "bf16"/"fp16"/"fp32" from the config
    own_optimizer: bool = False                # the config names a DeepSpeed optimizer
    micro_batch: int | None = None             # train_micro_batch_size_per_gpu
    # NVMe offload (offload_optimizer / offload_param with device "nvme"): their pinned swap buffers
    optimizer_buffer_count: int = 4            # offload_optimizer.buffer_count
    param_buffer_count: int = 5                # offload_param.buffer_count
    param_buffer_size: int = 100_000_000       # offload_param.buffer_size (elements)
    max_in_cpu: int = 1_000_000_000            # offload_param.max_in_cpu (elements kept in host memory)

    def overlaps(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | Path) -> "DeepSpeedKnobs":
        """Read the knobs from a ``ds_config.json`` (path or dict); "auto" keeps the default.

        >>> DeepSpeedKnobs.from_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e7},
        ...                             "bf16": {"enabled": True}}).reduce_bucket_size
        10000000
        """
        config = _load(config)
        zero = config.get("zero_optimization") or {}
        if not isinstance(zero, Mapping):
            raise EstimatorInputError("ds_config: zero_optimization must be an object")
        names = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
                 "stage3_max_live_parameters": "max_live_parameters",
                 "stage3_max_reuse_distance": "max_reuse_distance",
                 "stage3_param_persistence_threshold": "param_persistence_threshold"}
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in zero.items():
            name = names.get(key, key)
            if name in known and value != "auto" and name not in NOT_ZERO_KEYS:
                values[name] = _knob(key, value)
        values.update(_offload_knobs(zero))
        micro = config.get("train_micro_batch_size_per_gpu")
        if micro not in (None, "auto"):
            values["micro_batch"] = _knob("train_micro_batch_size_per_gpu", micro)
        return replace(cls(), **values, precision=_precision(config),
                       own_optimizer=isinstance(config.get("optimizer"), Mapping))


_OFFLOAD_KNOBS = {("offload_optimizer", "buffer_count"): "optimizer_buffer_count",
                  ("offload_param", "buffer_count"): "param_buffer_count",
                  ("offload_param", "buffer_size"): "param_buffer_size",
                  ("offload_param", "max_in_cpu"): "max_in_cpu"}


# fields that are not keys of zero_optimization itself (read from other parts of the config)
NOT_ZERO_KEYS = ("precision", "own_optimizer", *_OFFLOAD_KNOBS.values())


def _offload_knobs(zero: Mapping[str, Any]) -> dict[str, Any]:
    """The NVMe swap knobs of the ``offload_optimizer`` / ``offload_param`` sections."""
    values = {}
    for (section, key), name in _OFFLOAD_KNOBS.items():
        settings = zero.get(section) or {}
        if not isinstance(settings, Mapping):
            raise EstimatorInputError(f"ds_config: zero_optimization.{section} must be an object")
        value = settings.get(key, "auto")
        if value != "auto":
            values[name] = _knob(f"{section}.{key}", value)
    return values


def _load(config: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EstimatorInputError(f"DeepSpeed config not found: {path}") from None
    except json.JSONDecodeError as error:
        raise EstimatorInputError(f"malformed JSON in {path}: {error.msg} at line {error.lineno}") from None
    if not isinstance(loaded, dict):
        raise EstimatorInputError(f"{path} must hold a JSON object")
    return loaded


def _knob(key: str, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
        return int(value)
    raise EstimatorInputError(f"ds_config: {key} must be a non-negative number or true/false, got {value!r}")


def _precision(config: Mapping[str, Any]) -> str:
    for name in ("bf16", "fp16"):
        section = config.get(name) or {}
        if isinstance(section, Mapping) and section.get("enabled") in (True, "auto"):
            return name
    return "fp32"


MIN_AIO_BYTES = 2**20  # a tensor smaller than this is not swapped (swap_tensor/utils.py)


class DeepSpeedZero:
    """DeepSpeed's plans: stages 0-3, optimizer offload and parameter offload (stage 3); with
    ``disk``, ZeRO-Infinity's NVMe tier too (``zero3-offload-disk``: ``offload_optimizer`` on
    ``nvme``; ``zero3-offload-params-disk``: ``offload_param`` as well)."""

    name = "deepspeed"
    hybrid_stages = (3,)  # MiCS (mics_shard_size) and ZeRO++ hpZ shard within groups at stage 3 only
    communicators = 2     # the world group and its clone for ZeRO's collectives (utils/groups.py)

    def __init__(self, knobs: DeepSpeedKnobs = DeepSpeedKnobs(), disk: bool = False) -> None:
        self.knobs = knobs
        names = ("ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "zero3-offload-params")
        names += ("zero3-offload-disk", "zero3-offload-params-disk") if disk else ()
        self.plans = tuple(plan_spec(name) for name in names)

    def keeps_linear_inputs(self, plan: PlanSpec) -> bool:
        """Whether every linear keeps its input for backward, frozen or not.

        [Note: DeepSpeed's linear keeps its input]
        Entered as a context (``zero.Init``, how Hugging Face and accelerate build a stage-3 model),
        ``Init`` replaces ``torch.nn.functional.linear`` with ``zero3_linear_wrap`` for the rest of
        the process ("This will persist unless manually reset", ``partition_parameters.py``; v0.8 to
        today). Its ``LinearFunctionForZeroStage3`` saves ``input`` (with the weight) whatever
        requires grad (``linear.py``), where torch's own linear saves the input only to compute the
        weight's gradient. So under LoRA every frozen projection of ``nn.Linear`` keeps its input,
        as bitsandbytes' matmuls do. ``memory_efficient_linear: false`` turns the override off.

        >>> DeepSpeedZero().keeps_linear_inputs(plan_spec("zero3"))
        True
        >>> DeepSpeedZero().keeps_linear_inputs(plan_spec("zero2"))
        False
        """
        return plan.stage == 3 and self.knobs.memory_efficient_linear

    def terms(self, plan: PlanSpec, context: EngineContext) -> EngineTerms:
        policy = context.policy
        if policy.amp is None and policy.low_precision_states:
            raise EstimatorInputError(f"DeepSpeed keeps fp32 master weights when bf16/fp16 is enabled; "
                                      f"{policy.name} is not one of its modes (use bf16 or fp16)")
        p = policy.param_bytes
        master = FP32_BYTES if policy.mixed else 0
        psi, shard = context.psi, context.shard
        optimizer_per = master + context.fp32_state_bytes
        if plan.stage == 0:
            return self._stage0(context, optimizer_per)
        optimizer = optimizer_per * shard + context.factored_bytes(sharded=True)
        params = p * (shard if plan.stage == 3 else psi)
        grads = p * (shard if plan.stage >= 2 else psi)
        host: dict[str, int] = {}
        step = self._step(plan, context)
        if plan.offload:
            # Reduced gradient partitions go straight to the host's fp32 buffer the CPU
            # optimizer steps ("offloads optimizer states and gradients to CPU").
            host = nonzero(optimizer_states=optimizer, fp32_grads=FP32_BYTES * shard)
            optimizer, grads, step = 0, 0, {}
        before_logits: dict[str, int] = {}
        if plan.offload_params:
            host["params"], params, grads = params, 0, 0
            before_logits = self._partition_copy(context)
        cached, carvable = ({}, 0) if plan.offload else self._cached(plan, context)
        terms = EngineTerms(params, grads, optimizer, persistent=self._persistent(plan, context),
                            forward=self._forward(plan, context), step=step, host=host, cached=cached,
                            cached_carvable=carvable, before_logits=before_logits)
        return on_nvme(terms, plan, context, self.knobs) if plan.disk else terms

    @staticmethod
    def _partition_copy(context: EngineContext) -> dict[str, int]:
        """The head's host partition copied to the device while the head is fetched (``offload_param``).

        [Note: DeepSpeed's fetch from host partitions]
        ``all_gather_coalesced`` (``partition_parameters.py``, v0.8 to today) allocates the gathered
        buffer and passes ``param.ds_tensor.to(device)`` as the all-gather's input: with
        ``offload_param`` the partition lives in pinned host memory, so each fetch holds a device
        copy of it (1/N of the module's parameters) beside the full buffer until the gather ends.
        The largest fetch with the most activations alive is the last of forward, the head's
        (``lm_head``; tied or not, a vocab x hidden matrix), before its logits exist: that moment
        is every activation, the forward's gathered parameters and buckets, and this copy.
        Without a known head, the largest tensor stands in for it (an upper bound)."""
        arch = context.stats.architecture
        head = arch.vocab * arch.hidden if arch is not None and arch.lm_head else context.largest_tensor
        return nonzero(offloaded_partition_copy=context.policy.param_bytes * math.ceil(head / context.world_size))

    def _stage0(self, context: EngineContext, optimizer_per: int) -> EngineTerms:
        """No ZeRO: DeepSpeed's FP16/BF16 optimizer over the whole model on every rank."""
        policy, psi = context.policy, context.psi
        return EngineTerms(
            policy.param_bytes * psi, policy.grad_bytes * psi, optimizer_per * psi,
            step=self._flat_fp32_grads(context, psi))

    def _flat_fp32_grads(self, context: EngineContext, numel: int) -> dict[str, int]:
        mixed = context.policy.mixed
        temporaries = 0 if self.knobs.own_optimizer else step_temporary_bytes(
            context.optimizer, context.implementation, numel, numel, FP32_BYTES)
        return nonzero(fp32_grad_partition=(context.policy.grad_bytes + FP32_BYTES) * numel if mixed else 0,
                       optimizer_step_temporaries=temporaries)

    def _step(self, plan: PlanSpec, context: EngineContext) -> dict[str, int]:
        if plan.stage < 3:
            return self._flat_fp32_grads(context, context.shard)
        return self._flat_fp32_grads(context, min(self.knobs.sub_group_size, context.shard))

    def _cached(self, plan: PlanSpec, context: EngineContext) -> tuple[dict[str, int], int]:
        """The step's flat buffers as the caching allocator keeps them beside the next forward.

        [Note: DeepSpeed's step buffers in the cache]
        The step flattens each (sub-)group's 16-bit gradient partition into one new tensor and
        casts it to a second, fp32 one (``single_grad_partition``, ``_prepare_fp32_grad_for_sub_group``):
        two contiguous blocks of the partition's size, far larger than any tensor of the forward.
        They are freed after the step, but their segments stay cached and the next forward's
        tensors are carved from their own, smaller segments first (best fit): reserved and
        nvidia-smi keep both beside the activations. At stage 3 the fp32 one reuses the segment
        of ``initialize_optimizer_states``'s fp32 ``gradient_buffer`` (the same size, freed at
        init), which the first forward's tensors were carved from: it stays beside them only by
        what the forward did not fill (``cached_carvable``)."""
        if plan.stage == 0 or not context.policy.mixed:
            return {}, 0
        group = min(self.knobs.sub_group_size, context.shard) if plan.stage == 3 else context.shard
        flat = context.policy.grad_bytes * group
        if plan.stage < 3:
            return nonzero(cached_step_segments=flat + FP32_BYTES * group), 0
        return nonzero(cached_step_segments=flat), FP32_BYTES * group

    def _persistent(self, plan: PlanSpec, context: EngineContext) -> dict[str, int]:
        if plan.stage == 3:
            return nonzero(reduce_bucket=context.policy.grad_bytes * self.knobs.reduce_bucket_size)
        return {}

    def _forward(self, plan: PlanSpec, context: EngineContext) -> dict[str, int]:
        knobs, p = self.knobs, context.policy.param_bytes
        if plan.stage < 3:
            buffers = (2 if knobs.overlaps(plan.stage) else 1) if knobs.contiguous_gradients else 0
            return nonzero(contiguous_gradient_buckets=buffers * context.policy.grad_bytes * knobs.reduce_bucket_size)
        # The coordinator prefetches up to the live budget, and does not release a parameter it will
        # use again within max_reuse_distance elements of fetches (__params_to_release): at the turn
        # from forward to backward the last max_reuse_distance / 2 elements of the forward stay
        # gathered (their reuse is that far ahead in forward, and as far back in backward).
        # The live budget caps the prefetch only: the running module's parameters are fetched
        # whatever it says (fetch_sub_module), so a tensor larger than the budget is still whole.
        live = max(context.largest_tensor,
                   min(knobs.max_live_parameters, context.largest_tensor + knobs.prefetch_bucket_size))
        kept = knobs.max_reuse_distance // 2
        return nonzero(gathered_parameters=p * min(live + kept, context.psi),
                       module_gradients=context.policy.grad_bytes * context.largest_tensor)


def on_nvme(terms: EngineTerms, plan: PlanSpec, context: EngineContext, knobs: DeepSpeedKnobs) -> EngineTerms:
    """A ``cpu`` offload plan's terms with its host bytes moved as ``device: "nvme"`` moves them.

    [Note: DeepSpeed's NVMe tier]
    ``stage3.py`` with ``offload_optimizer.device: nvme`` swaps each optimizer sub-group (fp32
    master, optimizer state, and the fp32 gradients swapped out at reduction) to files under
    ``nvme_path`` when the sub-group is at least ``MIN_AIO_BYTES`` of fp32 (smaller ones stay in
    host memory); host memory keeps ``buffer_count`` pinned swap buffers of the largest
    sub-group (``OptimizerSwapper``) and one fp32 gradient buffer of it
    (``initialize_optimizer_states``). ``offload_param.device: nvme`` keeps up to ``max_in_cpu``
    parameter elements per rank in pinned host memory (``_create_param_groups_fp16_flat_cpu_memory``)
    and the rest in files, read through ``buffer_count`` x ``buffer_size`` pinned elements
    (``AsyncPartitionedParameterSwapper``). Sub-groups are taken as ``min(sub_group_size, shard)``
    elements each. The device holds what the ``cpu`` plan holds.
    """
    host, disk = dict(terms.host), {}
    sub_group = min(knobs.sub_group_size, context.shard)
    if sub_group * FP32_BYTES >= MIN_AIO_BYTES:
        disk = nonzero(optimizer_states=host.pop("optimizer_states", 0), fp32_grads=host.pop("fp32_grads", 0))
        host.update(nonzero(optimizer_swap_buffers=knobs.optimizer_buffer_count * sub_group * FP32_BYTES,
                            fp32_grad_buffer=sub_group * FP32_BYTES))
    if plan.offload_params:
        p = context.policy.param_bytes
        in_cpu = min(knobs.max_in_cpu, context.shard)
        host["params"] = p * in_cpu
        disk.update(nonzero(params=p * (context.shard - in_cpu)))
        host.update(nonzero(param_swap_buffers=p * knobs.param_buffer_count * knobs.param_buffer_size))
    return replace(terms, host=nonzero(**host), disk=disk)
