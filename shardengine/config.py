"""``ShardConfig``: every option of :func:`shardengine.shard`, validated up front."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .comm import COLLECTIVES

STAGES = (0, 1, 2, 3)
NODE = "node"  # shard_group_size: the launcher's ranks per node


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
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ConfigError(f"stage must be one of {STAGES} (or 'auto'), got {self.stage!r}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")
        if self.wrap is not None:
            wrap = tuple(self.wrap) if not isinstance(self.wrap, type) else (self.wrap,)
            if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in wrap):
                raise ConfigError(f"wrap must be nn.Module subclasses, got {self.wrap!r}")
            object.__setattr__(self, "wrap", wrap)
        if self.wrap_min_params is not None and self.wrap_min_params < 1:
            raise ConfigError(f"wrap_min_params must be >= 1, got {self.wrap_min_params!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.max_inflight_buckets < 1:
            raise ConfigError(f"max_inflight_buckets must be >= 1, got {self.max_inflight_buckets!r}")
        self._check_precision()
        if self.offload_optimizer and self.stage == 0:
            raise ConfigError("offload_optimizer needs stage >= 1: at stage 0 every rank keeps "
                              "the whole optimizer state")
        if self.collectives not in COLLECTIVES:
            raise ConfigError(f"collectives must be one of {COLLECTIVES}, got {self.collectives!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        size = self.shard_group_size
        if size is not None and size != NODE and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"shard_group_size must be an int >= 1, {NODE!r} or None, got {size!r}")

    def _check_precision(self) -> None:
        from .precision import parse_dtype  # precision imports ConfigError from here
        object.__setattr__(self, "param_dtype", parse_dtype(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "reduce_dtype", parse_dtype(self.reduce_dtype, "reduce_dtype"))
        if not self.initial_loss_scale > 0:
            raise ConfigError(f"initial_loss_scale must be > 0, got {self.initial_loss_scale!r}")
        if self.loss_scale is None:
            return
        if self.param_dtype != torch.float16:
            raise ConfigError(f"loss_scale applies to fp16 training only (param_dtype is "
                              f"{self.param_dtype}); bf16 and fp32 need no loss scaling")
        if self.loss_scale != "dynamic" and not (isinstance(self.loss_scale, (int, float))
                                                 and self.loss_scale > 0):
            raise ConfigError(f"loss_scale must be 'dynamic' or a positive number, got {self.loss_scale!r}")

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
        values = {f.name: getattr(config, f.name) for f in fields(cls)} if config else {}
        values.update(options)
        if stage is not None:
            values["stage"] = stage
        return cls(**values)


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
