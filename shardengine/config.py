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

from .comm import COLLECTIVES

STAGES = (0, 1, 2, 3)
NODE = "node"  # shard_group_size: the launcher's ranks per node
MAX_TIMEOUT_S = timedelta.max.total_seconds()  # what a timedelta, and so a process group, can hold


class ConfigError(ValueError):
    """An option of ``shard()`` is unknown or out of range."""


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
        A tensor no rule fills is an error (see ``meta_init.py``).
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
        broadcast per rank, both in place (see shardengine/comm.py); NCCL gets
        the textbook collectives. "native": the textbook collectives everywhere.
        The byte counters report what is actually issued.
    find_unused_parameters: accepted for DDP compatibility and ignored: a
        parameter that gets no gradient on any rank in a step is always left
        untouched (no update, no weight decay, no step count), found by the one
        small all-reduce every step makes anyway (see step_sync.py).
    broadcast_buffers: after every backward, rank 0's buffers (BatchNorm
        statistics) are broadcast to all ranks, so every forward starts from rank 0's
        buffers and replicas stay identical (DDP's default). False keeps each rank's own.
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

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalised values are set once, here

    def _check_precision(self) -> None:
        from .precision import parse_dtype  # precision imports ConfigError from here
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
    shardengine.config.ConfigError: shard_group_size=3 does not divide the world size 8: hybrid sharding needs N/k groups of k ranks each (k = 1, 2, 4 or 8 here)
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
