"""``ShardConfig``: every option of :func:`shardengine.shard`, validated up front.

The engine-wide options are fields of their own; the rest are grouped into
frozen policies (``policies.py``: ``MixedPrecision``, ``Offload``,
``Compression``, ``Hybrid``, ``Stage3``, ``Activations``), each also given and read as a flat
keyword.

>>> cfg = ShardConfig(stage=3, param_dtype="bf16", prefetch=2)
>>> cfg.precision.param_dtype, cfg.param_dtype, cfg.stage3.prefetch
(torch.bfloat16, torch.bfloat16, 2)
>>> ShardConfig(stage=3, precision=MixedPrecision(param_dtype="bf16"), param_dtype="fp16").param_dtype
torch.float16
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from torch import nn

from .distributed.traffic import COLLECTIVES
from .errors import ConfigError
from .policies import (NODE, Activations, Compression, Hybrid, MixedPrecision, Offload, Stage3, boolean,
                       integer, parse_compression, positive_number)

STAGE_NUMBERS = (0, 1, 2, 3)
MAX_TIMEOUT_S = timedelta.max.total_seconds()  # what a timedelta, and so a process group, can hold

POLICIES = {"precision": MixedPrecision, "offload": Offload, "hybrid": Hybrid, "stage3": Stage3,
            "activations": Activations}


class _FlatOption(property):
    """``cfg.<keyword>``: a policy's field read as the flat ``shard()`` keyword it is given as.

    [Note: each option listed once] An engine-wide option is a field of ``ShardConfig``; a
    policy's option is one ``_FlatOption`` line in its class body. ``FLAT_OPTIONS`` and
    ``OPTION_NAMES`` are read from those two lists, never written out again."""

    def __init__(self, group: str, name: str) -> None:
        super().__init__(lambda cfg: getattr(getattr(cfg, group), name))
        self.group, self.name = group, name
        self.__doc__ = f"``{group}.{name}``"


@dataclass(frozen=True, init=False)
class ShardConfig:
    """Options of :func:`shardengine.shard`.

    ``ShardConfig(stage, **options)`` takes every field below and every field of
    the policies as a flat keyword (``param_dtype="bf16"``, ``prefetch=2``); a flat
    keyword overrides that field of a policy given alongside it. Unknown names
    are a ``ConfigError``.

    stage: 0 (data parallel), 1 (+ optimizer states sharded), 2 (+ gradients),
        3 (+ parameters).
    bucket_mb: size of a gradient bucket at stages 0-2; each bucket is reduced
        as one collective, as soon as all its gradients are ready.
    timeout_s: collective timeout; a dedicated process group is created with it.
    allow_unknown_optimizer: shard an optimizer class not known to be
        element-wise (at your own risk).
    whole_tensor_optimizers: optimizer classes (beyond ``torch.optim.Muon`` and
        ``torch.optim.Adafactor``) whose update reads whole parameters; at stages
        1-3 each of their parameters is stepped whole by one owner rank
        (see optim/whole_tensor.py and docs/matrix-optimizers.md).
    max_inflight_buckets: stages 2-3: gradient reductions in flight at once
        (bounds the transient full-gradient buffers). Default 1, FSDP2's depth
        (see [Note: one reduction in flight] in step/reducer.py); raise it to
        overlap more reductions with backward at the cost of one unit's (or
        bucket's) full gradient each.
    collectives: "auto" (default) picks the fastest correct implementation per
        backend: on Gloo, reduce-scatter as an all-reduce and all-gather as one
        broadcast per rank, both in place (see shardengine/distributed/communicator.py); NCCL gets
        the textbook collectives. "native": the textbook collectives everywhere.
        The byte counters report what is actually issued.
    find_unused_parameters: accepted for DDP compatibility and ignored: a
        parameter that gets no gradient on any rank in a step is always left
        untouched (no update, no weight decay, no step count), found by the one
        small all-reduce every step makes anyway (see step/agreement.py). Kept as a
        field so that ranks passing different values are told so, as for any option.
    broadcast_buffers: after every backward, rank 0's buffers (BatchNorm
        statistics) are broadcast to all ranks, so every forward starts from rank 0's
        buffers and replicas stay identical (DDP's default). False keeps each rank's own.
    step_in_backward: stages 1-3: step each bucket's reduced gradient slice as
        soon as it lands in backward and free it at once, so gradients never exist
        whole (see stages/in_backward.py and docs/memory.md). ``optimizer.step()``
        then only runs its hooks. Refused with clipping, accumulation (``no_sync``),
        ``join()``, fp16, optimizer offload and whole-tensor or unknown optimizers.
    precision: :class:`~shardengine.policies.MixedPrecision` (flat: ``param_dtype``,
        ``reduce_dtype``, ``loss_scale``, ``initial_loss_scale``).
    offload: :class:`~shardengine.policies.Offload` (flat: ``offload_optimizer``,
        ``offload_path``, ``offload_params``, ``offload_device_budget``).
    hybrid: :class:`~shardengine.policies.Hybrid` (flat: ``shard_group_size``).
    stage3: :class:`~shardengine.policies.Stage3` (flat: ``wrap``, ``wrap_min_params``,
        ``param_init_fn``, ``prefetch``, ``reshard_after_forward``).
    activations: :class:`~shardengine.policies.Activations` (flat: ``activation_checkpointing``,
        ``activation_offload``, ``measure_activations``): checkpointing and host offload of what
        each block keeps, and counting it for ``memory_report()``.
    compression: compressed communication (see :class:`~shardengine.policies.Compression`
        and distributed/compression/collectives.py). None (default): exact. A string compresses the
        gradient reduction: "bf16" / "fp16" (sent in that dtype, summed in fp32),
        "int8" (block-quantized all-to-all reduce-scatter with error feedback) or
        "powersgd" (stage 0). A dict chooses per collective and tunes:
        ``{"grads": "int8", "params": "int8", "block_size": 256}``; "params":
        "int8" quantizes stage 3's parameter all-gathers (masters stay exact).
    """

    stage: int = 0
    bucket_mb: float = 25.0
    timeout_s: Optional[float] = None
    allow_unknown_optimizer: bool = False
    whole_tensor_optimizers: tuple[type, ...] = ()
    max_inflight_buckets: int = 1
    collectives: str = "auto"
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    step_in_backward: bool = False
    precision: MixedPrecision = MixedPrecision()
    offload: Offload = Offload()
    hybrid: Hybrid = Hybrid()
    stage3: Stage3 = Stage3()
    activations: Activations = Activations()
    compression: Union[Compression, str, dict, None] = None

    param_dtype = _FlatOption("precision", "param_dtype")
    reduce_dtype = _FlatOption("precision", "reduce_dtype")
    loss_scale = _FlatOption("precision", "loss_scale")
    initial_loss_scale = _FlatOption("precision", "initial_loss_scale")
    offload_optimizer = _FlatOption("offload", "optimizer")
    offload_path = _FlatOption("offload", "path")
    offload_params = _FlatOption("offload", "params")
    offload_device_budget = _FlatOption("offload", "device_budget")
    shard_group_size = _FlatOption("hybrid", "shard_group_size")
    wrap = _FlatOption("stage3", "wrap")
    wrap_min_params = _FlatOption("stage3", "wrap_min_params")
    param_init_fn = _FlatOption("stage3", "param_init_fn")
    prefetch = _FlatOption("stage3", "prefetch")
    reshard_after_forward = _FlatOption("stage3", "reshard_after_forward")
    generate_gather_bytes = _FlatOption("stage3", "generate_gather_bytes")
    activation_checkpointing = _FlatOption("activations", "checkpoint")
    activation_offload = _FlatOption("activations", "offload")
    measure_activations = _FlatOption("activations", "measure")

    def __init__(self, stage: Union[int, str] = 0, **options: Any) -> None:
        unknown = sorted(set(options) - set(known_options()))
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; known options: {known_options()}")
        for f in fields(self):
            if f.name in POLICIES:
                self._set(f.name, _policy_with(f.name, options))
            elif f.name != "stage":
                self._set(f.name, options.get(f.name, f.default))
        self._set("stage", stage)
        self.__post_init__()

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage not in STAGE_NUMBERS:
            raise ConfigError(f"stage must be one of {STAGE_NUMBERS} (or 'auto'), got {self.stage!r}")
        self._set("stage", int(self.stage))
        # bucket_bytes = bucket_mb * 2**20 must be a finite number of bytes
        self._set("bucket_mb", positive_number("bucket_mb", self.bucket_mb, limit=sys.float_info.max / 2**20))
        self._set("whole_tensor_optimizers", _optimizer_classes(self.whole_tensor_optimizers))
        if self.timeout_s is not None:
            self._set("timeout_s", positive_number("timeout_s", self.timeout_s, limit=MAX_TIMEOUT_S))
        self._set("max_inflight_buckets", integer("max_inflight_buckets", self.max_inflight_buckets, minimum=1))
        for name in ("allow_unknown_optimizer", "find_unused_parameters", "broadcast_buffers", "step_in_backward"):
            boolean(name, getattr(self, name))
        if self.step_in_backward:
            self._check_step_in_backward()
        if self.offload_optimizer and self.stage == 0:
            raise ConfigError("offload_optimizer needs stage >= 1: at stage 0 every rank keeps "
                              "the whole optimizer state")
        if self.offload.moves_params and self.stage != 3:
            raise ConfigError(f"offload_params (or offload_device_budget) needs stage=3 (got stage={self.stage}): only stage 3 "
                              "frees the full parameters between uses, so only there can their shards "
                              "live off the device; at stages 1-2 use offload_optimizer="
                              + ('"disk"' if self.offload.params_on_disk else "True"))
        if not isinstance(self.collectives, str) or self.collectives not in COLLECTIVES:
            raise ConfigError(f"collectives must be one of {COLLECTIVES}, got {self.collectives!r}")
        self._set("compression", parse_compression(self.compression))
        if self.compression is not None:
            self.compression.check_for(self.stage, self.param_dtype, self.reduce_dtype or self.param_dtype)

    def _check_step_in_backward(self) -> None:
        """What shard() knows cannot be combined with the step inside backward (stages/in_backward.py)."""
        conflicts = [(self.stage == 0, "stage 0 (every rank steps every parameter; nothing is sharded to step "
                      "where it lands)", "Use stage 1, 2 or 3."),
                     (self.param_dtype == torch.float16, "fp16 loss scaling (an overflow must skip a step "
                      "that is already taken)", "Use param_dtype='bf16' (no loss scaling)."),
                     (bool(self.offload_optimizer), "offload_optimizer (the step runs on the host, after "
                      "backward)", "Drop offload_optimizer or step_in_backward."),
                     (self.offload.moves_params, "offload_params or offload_device_budget (the host units "
                      "step on the host, after backward)", "Drop them or step_in_backward.")]
        for conflicting, conflict, instead in conflicts:
            if conflicting:
                raise ConfigError(f"{conflict} cannot be combined with step_in_backward=True. {instead}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalised values are set once, here

    @property
    def mixed_precision(self) -> bool:
        return self.precision.enabled

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    def options(self) -> dict[str, Any]:
        """Every option besides ``stage``, by its flat ``shard()`` keyword."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    @classmethod
    def from_kwargs(cls, config: Optional["ShardConfig"], stage: Union[int, str, None],
                    options: dict[str, Any]) -> "ShardConfig":
        """Merge ``shard()``'s ``config=``, ``stage=`` and keyword options; reject unknown names."""
        unknown = sorted(set(options) - set(known_options()))
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; known options: {known_options()}")
        if config is not None and not isinstance(config, ShardConfig):
            raise ConfigError(f"config must be a ShardConfig, got {type(config).__name__}; "
                              "pass options as keyword arguments instead")
        values = {f.name: getattr(config, f.name) for f in fields(cls)} if config else {}
        values.update(options)  # a flat keyword overrides that field of config's policy
        if stage is not None:
            values["stage"] = stage
        return cls(**values)


# The flat keywords of ``shard()`` that live in a policy: keyword -> (ShardConfig field, policy field).
FLAT_OPTIONS = {keyword: (option.group, option.name) for keyword, option in vars(ShardConfig).items()
                if isinstance(option, _FlatOption)}
# Every option of ``shard()`` besides ``stage``, flat, in the order ranks compare them (state/fingerprint.py).
OPTION_NAMES = tuple(f.name for f in fields(ShardConfig) if f.name != "stage" and f.name not in POLICIES) \
    + tuple(FLAT_OPTIONS)


def known_options() -> list[str]:
    """Every keyword ``ShardConfig`` and ``shard()`` take as an option."""
    return sorted({f.name for f in fields(ShardConfig)} | set(FLAT_OPTIONS))


def _policy_with(group: str, options: dict[str, Any]) -> Any:
    """The ``group`` policy given in ``options`` (or the default), with the flat keywords of ``options`` applied."""
    cls = POLICIES[group]
    policy = options.get(group)
    if policy is None:
        policy = cls()
    elif not isinstance(policy, cls):
        raise ConfigError(f"{group} must be a {cls.__name__}, got {policy!r}")
    changes = {name: options[keyword] for keyword, (g, name) in FLAT_OPTIONS.items()
               if g == group and keyword in options}
    return replace(policy, **changes) if changes else policy


def _optimizer_classes(value: Any) -> tuple[type, ...]:
    """``whole_tensor_optimizers`` as a tuple of torch.optim.Optimizer subclasses."""
    classes = (value,) if isinstance(value, type) else value
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
        classes = (classes,)
    classes = tuple(classes)
    if not all(isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) for cls in classes):
        raise ConfigError("whole_tensor_optimizers must be torch.optim.Optimizer subclasses (a class "
                          f"or a tuple of classes), got {value!r}")
    return classes


def check_shard_arguments(model: Any, micro_batch: Any, seq_len: Any, example_inputs: Any,
                          memory_budget_bytes: Any) -> None:
    """The arguments of ``shard()`` that are not ShardConfig fields (``stage="auto"``'s inputs: checked at
    every stage, so a script that passes them whatever its ``--stage`` finds a bad one at once)."""
    if not isinstance(model, nn.Module):
        kind = f"the class {model.__qualname__}" if isinstance(model, type) else type(model).__name__
        raise ConfigError(f"model must be a torch.nn.Module instance, got {kind}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if value is not None:
            integer(name, value, minimum=1)
    if example_inputs is not None and not callable(example_inputs):
        raise ConfigError(f"example_inputs must be callable (micro_batch, seq_len) -> inputs, "
                          f"got {example_inputs!r}")
    if memory_budget_bytes is not None:
        positive_number("memory_budget_bytes", memory_budget_bytes)
        if memory_budget_bytes < 1:
            raise ConfigError(f"memory_budget_bytes is a number of bytes, at least 1, got {memory_budget_bytes!r}")


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
