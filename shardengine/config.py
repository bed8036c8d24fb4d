"""``ShardConfig``: every option of :func:`shardengine.shard`, validated up front."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .distributed.traffic import COLLECTIVES
from .errors import ConfigError
from .step.mixed_precision import parse_dtype

STAGES = (0, 1, 2, 3)
NODE = "node"  # shard_group_size: the launcher's ranks per node
MAX_TIMEOUT_S = timedelta.max.total_seconds()  # what a timedelta, and so a process group, can hold


@dataclass(frozen=True)
class ShardConfig:
    """Options of :func:`shardengine.shard`.

    stage: 0 (data parallel), 1 (+ optimizer states sharded), 2 (+ gradients),
        3 (+ parameters).
    bucket_mb: size of a gradient bucket at stages 0-2; each bucket is reduced
        as one collective, as soon as all its gradients are ready.
    wrap: stage 3 units: module classes to wrap as units. Default: every element
        of an ``nn.ModuleList`` / ``nn.Sequential`` block list, plus the root.
    wrap_min_params: stage 3: also wrap any module with at least this many
        parameters (not already inside a unit).
    param_init_fn: stage 3 with a meta-device model: the init rule, called on
        every submodule whose subtree holds a tensor of the unit being
        materialized, children first (``module.apply`` order). Default: a Hugging
        Face model's own ``_init_weights``, else each module's ``reset_parameters()``.
        A tensor no rule fills is an error (see ``flat/meta_init.py``).
    timeout_s: collective timeout; a dedicated process group is created with it.
    allow_unknown_optimizer: shard an optimizer class not known to be
        element-wise (at your own risk).
    max_inflight_buckets: stages 2-3: gradient reductions in flight at once
        (bounds the transient full-gradient buffers).
    param_dtype: "bf16"/"fp16" (or a torch dtype): compute in this dtype with
        fp32 master weights and fp32 optimizer state. None: the model's dtype.
    reduce_dtype: dtype of gradient reduction; default ``param_dtype``.
    loss_scale: fp16 only: "dynamic" (default) or a fixed float.
    initial_loss_scale: fp16 with dynamic scaling: the starting scale.
    offload_optimizer: stages 1-3: fp32 master slices and optimizer state live
        in host memory and the step runs on the CPU (ZeRO-Offload).
    prefetch: stage 3: units gathered ahead of use (forward and backward).
    reshard_after_forward: stage 3: free a unit's parameters after its forward
        (else keep them until its backward: one all-gather fewer, more memory).
    collectives: "auto" (default) picks the fastest correct implementation per
        backend: on Gloo, reduce-scatter as an all-reduce and all-gather as one
        broadcast per rank, both in place (see shardengine/distributed/communicator.py); NCCL gets
        the textbook collectives. "native": the textbook collectives everywhere.
        The byte counters report what is actually issued.
    find_unused_parameters: accepted for DDP compatibility and ignored: a
        parameter that gets no gradient on any rank in a step is always left
        untouched (no update, no weight decay, no step count), found by the one
        small all-reduce every step makes anyway (see step/agreement.py).
    broadcast_buffers: after every backward, rank 0's buffers (BatchNorm
        statistics) are broadcast to all ranks, so every forward starts from rank 0's
        buffers and replicas stay identical (DDP's default). False keeps each rank's own.
    compression: compressed communication (see :class:`Compression` and
        distributed/compression/collectives.py). None (default): exact. A string compresses the
        gradient reduction: "bf16" / "fp16" (sent in that dtype, summed in fp32),
        "int8" (block-quantized all-to-all reduce-scatter with error feedback) or
        "powersgd" (stage 0). A dict chooses per collective and tunes:
        ``{"grads": "int8", "params": "int8", "block_size": 256}``; "params":
        "int8" quantizes stage 3's parameter all-gathers (masters stay exact).
    shard_group_size: hybrid sharding at stages 1-3: shard within groups of this
        many consecutive ranks and replicate across the groups (it must divide the
        world size); "node": the launcher's ranks per node (``LOCAL_WORLD_SIZE``).
        None: one group of every rank (plain sharding). Stage 0 shards nothing, so
        there it changes nothing (see :func:`resolve_shard_group_size`).
    """

    stage: int = 0
    bucket_mb: float = 25.0
    wrap: Optional[tuple[type, ...]] = None
    wrap_min_params: Optional[int] = None
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    timeout_s: Optional[float] = None
    allow_unknown_optimizer: bool = False
    max_inflight_buckets: int = 2
    param_dtype: Any = None
    reduce_dtype: Any = None
    loss_scale: Union[str, float, None] = None
    initial_loss_scale: float = 2.0 ** 16
    offload_optimizer: bool = False
    prefetch: int = 1
    reshard_after_forward: bool = True
    collectives: str = "auto"
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    shard_group_size: Union[int, str, None] = None
    compression: Union["Compression", str, dict, None] = None

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage not in STAGES:
            raise ConfigError(f"stage must be one of {STAGES} (or 'auto'), got {self.stage!r}")
        self._set("stage", int(self.stage))
        # bucket_bytes = bucket_mb * 2**20 must be a finite number of bytes
        self._set("bucket_mb", _positive_number("bucket_mb", self.bucket_mb, limit=sys.float_info.max / 2**20))
        self._set("wrap", _module_classes(self.wrap))
        if self.wrap_min_params is not None:
            self._set("wrap_min_params", _integer("wrap_min_params", self.wrap_min_params, minimum=1))
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ConfigError(f"param_init_fn must be callable (module -> None), got {self.param_init_fn!r}")
        if self.timeout_s is not None:
            self._set("timeout_s", _positive_number("timeout_s", self.timeout_s, limit=MAX_TIMEOUT_S))
        self._set("max_inflight_buckets", _integer("max_inflight_buckets", self.max_inflight_buckets, minimum=1))
        self._set("prefetch", _integer("prefetch", self.prefetch, minimum=0))
        size = self.shard_group_size
        if size is not None and size != NODE:
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise ConfigError(f"shard_group_size must be an int >= 1, {NODE!r} or None, got {size!r}")
            self._set("shard_group_size", int(size))
        for name in ("allow_unknown_optimizer", "offload_optimizer", "reshard_after_forward",
                     "find_unused_parameters", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._check_precision()
        if self.offload_optimizer and self.stage == 0:
            raise ConfigError("offload_optimizer needs stage >= 1: at stage 0 every rank keeps "
                              "the whole optimizer state")
        if not isinstance(self.collectives, str) or self.collectives not in COLLECTIVES:
            raise ConfigError(f"collectives must be one of {COLLECTIVES}, got {self.collectives!r}")
        self._set("compression", parse_compression(self.compression))
        if self.compression is not None:
            self.compression.check_for(self.stage, self.param_dtype, self.reduce_dtype or self.param_dtype)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalised values are set once, here

    def _check_precision(self) -> None:
        self._set("param_dtype", parse_dtype(self.param_dtype, "param_dtype"))
        self._set("reduce_dtype", parse_dtype(self.reduce_dtype, "reduce_dtype"))
        self._set("initial_loss_scale", _positive_number("initial_loss_scale", self.initial_loss_scale))
        if self.loss_scale is None:
            return
        if self.param_dtype != torch.float16:
            raise ConfigError(f"loss_scale applies to fp16 training only (param_dtype is "
                              f"{self.param_dtype}); bf16 and fp32 need no loss scaling")
        if self.loss_scale != "dynamic":
            self._set("loss_scale", _positive_number("loss_scale", self.loss_scale, also="or 'dynamic'"))

    @property
    def mixed_precision(self) -> bool:
        return self.param_dtype is not None and self.param_dtype != torch.float32

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @classmethod
    def from_kwargs(cls, config: Optional["ShardConfig"], stage: Union[int, str, None],
                    options: dict[str, Any]) -> "ShardConfig":
        """Merge ``shard()``'s ``config=``, ``stage=`` and keyword options; reject unknown names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; known options: {sorted(known)}")
        if config is not None and not isinstance(config, ShardConfig):
            raise ConfigError(f"config must be a ShardConfig, got {type(config).__name__}; "
                              "pass options as keyword arguments instead")
        values = {f.name: getattr(config, f.name) for f in fields(cls)} if config else {}
        values.update(options)
        if stage is not None:
            values["stage"] = stage
        return cls(**values)


GRAD_COMPRESSIONS = ("bf16", "fp16", "int8", "powersgd")
PARAM_COMPRESSIONS = ("int8",)
_LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Compression:
    """What ``shard(compression=...)`` compresses, and how (see distributed/compression/collectives.py).

    grads: the gradient reduction. "bf16" / "fp16": every value crosses the wire
        once in that dtype, the owner sums in fp32. "int8": block-wise int8 with one
        fp32 scale per ``block_size`` elements, sent by one all-to-all (each value
        quantized once), with error feedback (what a rank could not send is added
        to its next reduction). "powersgd": rank-``powersgd_rank`` PowerSGD with
        warm start and error feedback, stage 0 only; a tensor is compressed when that
        saves a factor ``powersgd_min_compression_rate`` (0: every matrix; torch's
        hook's rule, see distributed/compression/powersgd.py). At stage 0 the reduced
        chunks are all-gathered in the same format (so every replica applies the
        same gradient).
    params: "int8": stage 3 all-gathers block-quantized parameters for forward
        and backward; the sharded parameters and fp32 masters stay exact.

    >>> parse_compression("int8")
    Compression(grads='int8', params=None, block_size=256, powersgd_rank=4, powersgd_min_compression_rate=2.0)
    >>> parse_compression({"params": "int8", "block_size": 64}).params
    'int8'
    """

    grads: Optional[str] = None
    params: Optional[str] = None
    block_size: int = 256
    powersgd_rank: int = 4
    powersgd_min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        if self.grads is not None and self.grads not in GRAD_COMPRESSIONS:
            raise ConfigError(f"compression grads must be one of {GRAD_COMPRESSIONS} (or None), got {self.grads!r}")
        if self.params is not None and self.params not in PARAM_COMPRESSIONS:
            raise ConfigError(f"compression params must be one of {PARAM_COMPRESSIONS} (or None), "
                              f"got {self.params!r}")
        _integer("compression block_size", self.block_size, minimum=1)
        _integer("compression powersgd_rank", self.powersgd_rank, minimum=1)
        rate = self.powersgd_min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 <= rate < math.inf:
            raise ConfigError(f"compression powersgd_min_compression_rate must be a finite number >= 0, got {rate!r}")

    def check_for(self, stage: int, param_dtype: Optional[torch.dtype], grad_dtype: Optional[torch.dtype]) -> None:
        """Refuse what cannot be done correctly with these other options."""
        if self.grads == "powersgd" and stage != 0:
            raise ConfigError(f"compression grads='powersgd' needs stage 0 (got stage {stage}): PowerSGD "
                              "all-reduces low-rank factors of whole gradient matrices, and stages 1-3 "
                              "reduce-scatter flat shards; use 'int8' or 'bf16' there")
        if self.params is not None and stage != 3:
            raise ConfigError(f"compression params={self.params!r} needs stage 3 (got stage {stage}): only "
                              "stage 3 all-gathers parameters for compute; stages 1-2 all-gather the "
                              "updated parameters after the step, which must stay exact")
        if self.grads == "powersgd" and param_dtype == torch.float16:
            raise ConfigError("compression grads='powersgd' with param_dtype fp16 is not supported: an "
                              "overflowing gradient would put inf/NaN into PowerSGD's error feedback and "
                              "warm-start state for good; use bf16 or fp32")
        wire = _LOW_PRECISION.get(self.grads)
        if wire is not None and grad_dtype is not None and grad_dtype.itemsize <= wire.itemsize:
            raise ConfigError(f"compression grads={self.grads!r} with gradients already reduced in "
                              f"{dtype_name(grad_dtype)} would send nothing less; it compresses fp32 "
                              "gradients (set reduce_dtype='fp32', or use 'int8')")

    def check_grouping(self, stage: Union[int, str], group_size: int, world_size: int) -> None:
        """Hybrid sharding (groups of ``group_size`` < ``world_size``) with compressed gradients is
        refused; ``stage="auto"`` with options only some stages take, too."""
        if stage == "auto" and (self.grads == "powersgd" or self.params is not None):
            raise ConfigError(f"compression {self!r} only works at one stage (PowerSGD: 0, int8 params: 3); "
                              "with stage='auto' give a stage explicitly, or compress only gradients "
                              "with 'bf16', 'fp16' or 'int8'")
        if self.grads is not None and stage != 0 and group_size < world_size:
            raise ConfigError(f"compression grads={self.grads!r} with hybrid sharding (shard_group_size="
                              f"{group_size} of {world_size} ranks) is not supported: the reduction across "
                              "the groups would need its own compressed all-reduce and error feedback; "
                              "compress only params, or shard over all ranks")

    @property
    def enabled(self) -> bool:
        return self.grads is not None or self.params is not None


def parse_compression(value: Any) -> Optional[Compression]:
    """``compression=`` as a :class:`Compression` (None when nothing is compressed)."""
    if value is None or isinstance(value, Compression):
        return value if value is None or value.enabled else None
    if isinstance(value, str):
        return Compression(grads=value.lower())
    if isinstance(value, dict):
        known = {f.name for f in fields(Compression)}
        unknown = sorted(map(str, set(value) - known))
        if unknown:
            raise ConfigError(f"unknown compression key(s) {unknown}; known: {sorted(known)}")
        values = {k: v.lower() if k in ("grads", "params") and isinstance(v, str) else v for k, v in value.items()}
        compression = Compression(**values)
        return compression if compression.enabled else None
    raise ConfigError(f"compression must be None, a string ({', '.join(GRAD_COMPRESSIONS)}) or a dict like "
                      f"{{'grads': 'int8', 'params': 'int8'}}, got {value!r}")


def _positive_number(name: str, value: Any, limit: float = math.inf, also: str = "") -> float:
    """A finite real number in ``(0, limit]`` (not a bool, not a string), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0 < value <= limit:
        too_big = isinstance(value, numbers.Real) and math.isfinite(value) and value > limit
        bound = f" and <= {limit:.3g}" if too_big else ""
        raise ConfigError(f"{name} must be a finite number > 0{bound} {also}".rstrip() + f", got {value!r}")
    return float(value)


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _module_classes(wrap: Any) -> Optional[tuple[type, ...]]:
    """``wrap`` as a tuple of nn.Module subclasses (one class, or any iterable of them)."""
    if wrap is None:
        return None
    classes = (wrap,) if isinstance(wrap, type) else wrap
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
        classes = (classes,)
    classes = tuple(classes)
    if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
        raise ConfigError(f"wrap must be nn.Module subclasses (a class or a tuple of classes), got {wrap!r}")
    return classes


def check_shard_arguments(model: Any, micro_batch: Any, seq_len: Any, example_inputs: Any,
                          memory_budget_bytes: Any) -> None:
    """The arguments of ``shard()`` that are not ShardConfig fields."""
    if not isinstance(model, nn.Module):
        kind = f"the class {model.__qualname__}" if isinstance(model, type) else type(model).__name__
        raise ConfigError(f"model must be a torch.nn.Module instance, got {kind}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if value is not None:
            _integer(name, value, minimum=1)
    if example_inputs is not None and not callable(example_inputs):
        raise ConfigError(f"example_inputs must be callable (micro_batch, seq_len) -> inputs, "
                          f"got {example_inputs!r}")
    if memory_budget_bytes is not None:
        _positive_number("memory_budget_bytes", memory_budget_bytes)


def resolve_shard_group_size(option: Union[int, str, None], world_size: int,
                             local_world_size: Optional[int]) -> int:
    """The ranks per shard group ``shard_group_size=option`` means on ``world_size`` ranks.

    [Note: hybrid sharding's groups]
    Group g is ranks ``g*k .. g*k + k-1``; torchrun and SLURM number ranks node by
    node, so with ``k`` = ranks per node ("node") every group is one node and only
    the all-reduce of the reduced shards crosses nodes. ``k`` = N is plain sharding.

    >>> resolve_shard_group_size(None, 8, 4), resolve_shard_group_size("node", 8, 4)
    (8, 4)
    >>> resolve_shard_group_size(3, 8, None)
    Traceback (most recent call last):
    ...
    shardengine.errors.ConfigError: shard_group_size=3 does not divide the world size 8: hybrid sharding needs N/k groups of k ranks each (k = 1, 2, 4 or 8 here)
    """
    if option is None or world_size == 1:
        return world_size
    if option == NODE:
        if local_world_size is None:
            raise ConfigError("shard_group_size='node' needs the launcher's ranks per node (LOCAL_WORLD_SIZE, "
                              "set by torchrun; SLURM_NTASKS_PER_NODE under srun); none is set, so give "
                              "the group size as a number")
        option = local_world_size
    if world_size % option:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        listed = ", ".join(map(str, divisors[:-1])) + f" or {divisors[-1]}" if len(divisors) > 1 else "1"
        raise ConfigError(f"shard_group_size={option} does not divide the world size {world_size}: hybrid "
                          f"sharding needs N/k groups of k ranks each (k = {listed} here)")
    return option


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
