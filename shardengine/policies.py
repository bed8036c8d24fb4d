"""The option groups of ``shard()``: one frozen policy per concern.

[Note: options as policies]
``ShardConfig`` holds the engine-wide options (stage, buckets, timeout,
collectives) and one frozen policy per concern, as FSDP2 has
``MixedPrecisionPolicy`` and ``OffloadPolicy``:

* :class:`MixedPrecision`: compute and reduction dtypes, fp16 loss scaling;
* :class:`Offload`: what lives in host memory or on disk (the optimizer step; stage 3's parameters);
* :class:`Compression`: what crosses the wire compressed, and how;
* :class:`Hybrid`: shard within groups of ranks, replicate across them;
* :class:`Stage3`: which submodules are units, and how they are gathered;
* :class:`Activations`: what each block keeps for backward, where, and whether it is counted.

Each policy checks its own fields when built. Checks that span policies
(loss scaling needs fp16 is within one; offload needs stage >= 1, PowerSGD
needs stage 0 span two) are ``ShardConfig``'s. A new concern (a storage tier,
a whole-tensor optimizer path) is a new policy here, not five more flat
fields. ``shard()`` and ``ShardConfig`` still take every policy field as a
flat keyword (``param_dtype="bf16"``) and read it back flat
(``cfg.param_dtype``); see ``ShardConfig``.

>>> MixedPrecision(param_dtype="bf16")
MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=None, loss_scale=None, initial_loss_scale=65536.0)
>>> Stage3(prefetch=-1)
Traceback (most recent call last):
...
shardengine.errors.ConfigError: prefetch must be an int >= 0, got -1
"""

from __future__ import annotations

import math
import os
import re
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .activation_rules import CheckpointRule, OffloadValue, check_offload, parse_checkpoint
from .errors import ConfigError

DISK = "disk"  # Offload.optimizer: the optimizer state lives in files
NODE = "node"  # Hybrid.shard_group_size: the launcher's ranks per node
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(value: Union[str, torch.dtype, None], option: str) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ConfigError(f"{option} must be one of {sorted(DTYPES)} or a torch float dtype, got {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _set(policy: Any, name: str, value: Any) -> None:
    object.__setattr__(policy, name, value)  # frozen: normalised values are set once, when built


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def positive_number(name: str, value: Any, limit: float = math.inf, also: str = "") -> float:
    """A finite real number in ``(0, limit]`` (not a bool, not a string), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0 < value <= limit:
        too_big = isinstance(value, numbers.Real) and math.isfinite(value) and value > limit
        bound = f" and <= {limit:.3g}" if too_big else ""
        raise ConfigError(f"{name} must be a finite number > 0{bound} {also}".rstrip() + f", got {value!r}")
    return float(value)


def integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def forward_never_runs(cls: type) -> bool:
    """A container class (``nn.ModuleList``, ``nn.ModuleDict``, parameter lists): its parent calls
    its elements or reads their parameters, never it, so it is never a stage-3 unit.

    >>> forward_never_runs(nn.ModuleList), forward_never_runs(nn.Sequential)
    (True, False)
    """
    return cls.forward is nn.Module.forward


def module_classes(wrap: Any) -> Optional[tuple[type, ...]]:
    """``wrap`` as a tuple of nn.Module subclasses (one class, or any iterable of them)."""
    if wrap is None:
        return None
    classes = (wrap,) if isinstance(wrap, type) else wrap
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
        classes = (classes,)
    classes = tuple(classes)
    if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
        raise ConfigError(f"wrap must be nn.Module subclasses (a class or a tuple of classes), got {wrap!r}")
    containers = [cls.__name__ for cls in classes if forward_never_runs(cls)]
    if containers:  # a unit is gathered by its own forward's hooks
        raise ConfigError(
            f"wrap names {', '.join(containers)}, a container whose forward never runs (its parent calls "
            "its elements, or reads their parameters), so it cannot be gathered as a unit. Wrap the "
            "class of its elements, or of the module that calls them (to keep modules that ranks "
            "choose between in one unit); wrap=() keeps everything in the root unit.")
    return classes


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in a low-precision dtype with fp32 master weights and optimizer state.

    param_dtype: "bf16"/"fp16" (or a torch dtype): parameters, and so the forward
        and backward, in this dtype; the optimizer steps fp32 master slices.
        None: the model's dtype.
    reduce_dtype: dtype of the gradient reduction; default ``param_dtype``.
    loss_scale: fp16 only: "dynamic" (default) or a fixed float.
    initial_loss_scale: fp16 with dynamic scaling: the starting scale.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    loss_scale: Union[str, float, None] = None
    initial_loss_scale: float = 2.0 ** 16

    def __post_init__(self) -> None:
        _set(self, "param_dtype", parse_dtype(self.param_dtype, "param_dtype"))
        _set(self, "reduce_dtype", parse_dtype(self.reduce_dtype, "reduce_dtype"))
        _set(self, "initial_loss_scale", positive_number("initial_loss_scale", self.initial_loss_scale))
        if self.loss_scale is None:
            return
        if self.param_dtype != torch.float16:
            raise ConfigError(f"loss_scale applies to fp16 training only (param_dtype is "
                              f"{self.param_dtype}); bf16 and fp32 need no loss scaling")
        if self.loss_scale != "dynamic":
            _set(self, "loss_scale", positive_number("loss_scale", self.loss_scale, also="or 'dynamic'"))

    @property
    def enabled(self) -> bool:
        """Parameters are cast to a dtype other than fp32."""
        return self.param_dtype is not None and self.param_dtype != torch.float32


@dataclass(frozen=True)
class Offload:
    """Where training state lives when not on the device.

    optimizer (flat keyword ``offload_optimizer``): stages 1-3. True: fp32
        master slices and optimizer state live in host memory and the step runs
        on the CPU (ZeRO-Offload). ``"disk"``: they live in files under ``path``
        and host memory holds only the buckets being stepped (ZeRO-Infinity's
        place; see docs/offload.md).
    path (flat keyword ``offload_path``): an existing, writable directory for
        ``optimizer="disk"``, on a disk-backed filesystem (a tmpfs is memory).
        Each rank may pass its own (a node-local drive, a directory per rank): the
        ranks' files never meet, so only the tier must agree across ranks.
    params (flat keyword ``offload_params``): stage 3 only. True: each unit's
        parameter shard (the fp32 master, or the kept shard of a frozen bucket)
        and its reduced gradient shard live in host memory; a gather copies the
        shard to the device first (see docs/offload.md). It implies
        ``optimizer=True``: the master lives on the host, so the step runs there,
        as DeepSpeed's ``offload_param`` comes with ``offload_optimizer`` and
        FSDP2's ``CPUOffloadPolicy`` moves both. A number in (0, 1): that
        fraction of the parameter elements moves, whole units at a time, the
        others stay resident exactly as without offload (1.0 is True; for none
        pass False). See flat/residency.py. ``"disk"``: the parameter shards
        live in files under ``path``, read in ahead of each gather and dropped
        after it; it implies ``optimizer="disk"`` (ZeRO-Infinity's
        ``offload_param`` with ``offload_optimizer`` on NVMe), the reduced
        gradient shards stay in host memory.
    device_budget (flat keyword ``offload_device_budget``): stage 3 only, instead
        of ``params``: the most bytes of model states (each resident unit's
        parameter shard or master, gradient shard and optimizer state, per rank)
        that stay on the device; bytes (an int) or a string such as ``"8GiB"``.
        The units that do not fit move to the host as with ``params=True``.
        A fraction or a budget keeps the moved units' masters in host memory, so
        neither combines with the disk tier (``params="disk"`` or
        ``optimizer="disk"``).
    """

    optimizer: Union[bool, str] = False
    path: Optional[str] = None
    params: Union[bool, float, str] = False
    device_budget: Union[int, str, None] = None

    def __post_init__(self) -> None:
        if self.params == DISK:
            self._params_on_disk()
        else:
            _set(self, "params", _params_share(self.params))
        if self.device_budget is not None:
            _set(self, "device_budget", parse_bytes("offload_device_budget", self.device_budget))
            if self.params is not False:
                raise ConfigError(f"give offload_params={self.params!r} or offload_device_budget="
                                  f"{self.device_budget}, not both: each alone decides which units "
                                  "stay on the device")
        if self.partial_params and self.optimizer == DISK:
            raise ConfigError('a fraction or budget of offloaded parameters keeps their masters in host '
                              'memory, which offload_optimizer="disk" moves into files; use '
                              "offload_optimizer=True or False with it")
        if self.params is True and self.optimizer == DISK:
            raise ConfigError('offload_params=True keeps the masters in host memory, which '
                              'offload_optimizer="disk" moves into files; use offload_optimizer=True '
                              "(or leave it out: offload_params implies it)")
        if self.params is True:
            # the master is the parameter shard that moves, and the step runs where it lives
            _set(self, "optimizer", True)
        if not isinstance(self.optimizer, bool) and self.optimizer != DISK:
            raise ConfigError(f'offload_optimizer must be True, False or "disk", got {self.optimizer!r}')
        if self.optimizer == DISK and self.path is None:
            raise ConfigError('offload_optimizer="disk" needs offload_path= (Offload(path=...)): '
                              "an existing, writable directory for the optimizer's files")
        if self.optimizer != DISK and self.path is not None:
            raise ConfigError(f'offload_path is used only with offload_optimizer="disk", got '
                              f"offload_optimizer={self.optimizer!r}; pass both or neither")
        if self.path is not None:
            if not isinstance(self.path, (str, os.PathLike)):
                raise ConfigError(f"offload_path must be a directory path, got {self.path!r}")
            _set(self, "path", os.fspath(self.path))

    def _params_on_disk(self) -> None:
        """``params="disk"``: a trained bucket's only shard is its master, so the optimizer's
        files are the parameters' files; host memory for the masters would contradict it."""
        if self.optimizer is True:
            raise ConfigError('offload_params="disk" keeps the masters and the optimizer state in files, '
                              'which offload_optimizer=True puts in host memory; use offload_optimizer="disk" '
                              '(or leave it out: offload_params="disk" implies it)')
        if self.path is None:
            raise ConfigError('offload_params="disk" needs offload_path= (Offload(path=...)): an existing, '
                              "writable directory for the parameter shards' and the optimizer's files")
        _set(self, "optimizer", DISK)

    @property
    def on_disk(self) -> bool:
        return self.optimizer == DISK

    @property
    def partial_params(self) -> bool:
        """Some units' parameters move to the host and the others stay (a fraction or a budget)."""
        return isinstance(self.params, float) or self.device_budget is not None

    @property
    def moves_params(self) -> bool:
        """Any unit's parameters live off the device (on the host: all of them, or a fraction or
        budget's share; or in files, ``"disk"``)."""
        return self.params is not False or self.device_budget is not None

    @property
    def params_on_disk(self) -> bool:
        return self.params == DISK


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(name: str, value: Any) -> int:
    """A byte count >= 0: an int, or a string such as ``"8GiB"``, ``"512 MiB"``, ``"1.5GB"``.

    >>> parse_bytes("budget", "1.5KiB"), parse_bytes("budget", 7)
    (1536, 7)
    """
    number, unit = value, ""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).lower() not in _BYTE_UNITS:
            raise ConfigError(f"{name} must be a number of bytes, or a string like '8GiB', '512MiB' or "
                              f"'1.5GB' (units {sorted(set(_BYTE_UNITS) - {''})}), got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number) \
            or number < 0:
        raise ConfigError(f"{name} must be a number of bytes >= 0 (or a string like '8GiB'), got {value!r}")
    return int(number * _BYTE_UNITS[unit])


def _params_share(value: Any) -> Union[bool, float]:
    """``Offload.params`` normalised: True, False, or a fraction strictly between 0 and 1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real) and math.isfinite(value) and 0 < value <= 1:
        return True if value == 1 else float(value)
    raise ConfigError(f"offload_params must be True, False, \"disk\" or the fraction of the parameters to put on "
                      f"the host, a number > 0 and <= 1 (for none pass False), got {value!r}")


@dataclass(frozen=True)
class Hybrid:
    """Hybrid sharding at stages 1-3: shard within groups, replicate across them.

    shard_group_size: shard within groups of this many consecutive ranks and
        replicate across the groups (it must divide the world size); "node": the
        launcher's ranks per node (``LOCAL_WORLD_SIZE``). None: one group of every
        rank (plain sharding). Stage 0 shards nothing, so there it changes nothing
        (see :func:`~shardengine.config.resolve_shard_group_size`).
    """

    shard_group_size: Union[int, str, None] = None

    def __post_init__(self) -> None:
        size = self.shard_group_size
        if size is None or size == NODE:
            return
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise ConfigError(f"shard_group_size must be an int >= 1, {NODE!r} or None, got {size!r}")
        _set(self, "shard_group_size", int(size))


@dataclass(frozen=True)
class Stage3:
    """Stage 3's units: which submodules' parameters are gathered together, and when.

    wrap: module classes to wrap as units. Default: every element of an
        ``nn.ModuleList`` / ``nn.Sequential`` block list, plus the root. Stage 2
        ends its gradient buckets at these units too (flat/plan.py).
    wrap_min_params: also wrap any module with at least this many parameters
        (not already inside a unit).
    param_init_fn: with a meta-device model: the init rule, called on every
        submodule whose subtree holds a tensor of the unit being materialized,
        children first (``module.apply`` order). Default: a Hugging Face model's
        own ``_init_weights``, else each module's ``reset_parameters()``. A tensor
        no rule fills is an error (see ``flat/meta_init.py``).
    prefetch: units gathered ahead of use (forward and backward).
    reshard_after_forward: free a unit's parameters after its forward (else keep
        them until its backward: one all-gather fewer, more memory).
    generate_gather_bytes: ``model.generate()`` keeps the units it gathered for
        the whole call, up to this many bytes (an int or ``"4GiB"``), instead of
        gathering every unit once per new token; None (default) gathers per use.
    """

    wrap: Optional[tuple[type, ...]] = None
    wrap_min_params: Optional[int] = None
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    prefetch: int = 1
    reshard_after_forward: bool = True
    generate_gather_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        _set(self, "wrap", module_classes(self.wrap))
        if self.wrap_min_params is not None:
            _set(self, "wrap_min_params", integer("wrap_min_params", self.wrap_min_params, minimum=1))
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ConfigError(f"param_init_fn must be callable (module -> None), got {self.param_init_fn!r}")
        _set(self, "prefetch", integer("prefetch", self.prefetch, minimum=0))
        boolean("reshard_after_forward", self.reshard_after_forward)
        if self.generate_gather_bytes is not None:
            _set(self, "generate_gather_bytes", parse_bytes("generate_gather_bytes", self.generate_gather_bytes))


@dataclass(frozen=True)
class Activations:
    """What each block keeps for backward, and where it keeps it (docs/activations.md).

    The blocks are the stage-3 units (every ``nn.ModuleList`` element, or the ``wrap``
    classes), the same modules at stages 0-2; the root's own layers (embeddings, head)
    are never checkpointed or offloaded.

    checkpoint (flat keyword ``activation_checkpointing``): the memory estimator's
        vocabulary (activation_rules.py): "none", "full" (torch's non-reentrant
        checkpoint of each block), "every-k:K" (of every K-th block), "selective:mm"
        (save matmul and attention outputs, recompute the element-wise work),
        "selective:mm/2" (alias "selective:op": every second matmul output), "selective"
        (recompute only the attention core's s×s matrices; with fused attention there
        are none, and nothing is recomputed).
    offload (flat keyword ``activation_offload``): the tensors the named blocks save
        for backward go to host memory as forward saves them (pinned, on a side stream
        under CUDA) and come back a block ahead of their backward. True: every block but
        the last; an int n: the first n blocks; a float in (0, 1): that share of them,
        the first ones. Small tensors (under 1 KiB) and parameters stay. With
        checkpointing a checkpointed block keeps only its input, and only that moves.
    measure (flat keyword ``measure_activations``): count what every training forward
        keeps for backward, for ``memory_report()``'s ``activations`` fields. Off by
        default: counting passes each saved tensor through a Python saved-tensor hook,
        a cost on every step that DDP, FSDP2 and DeepSpeed do not charge; unmeasured,
        those fields are None. Checkpointing and offload always measure (their hooks
        are in place anyway), so ``measure`` only adds the hooks to a run without them.

    >>> Activations(checkpoint="every-k:2", offload=True).rule.every
    2
    >>> Activations().measured, Activations(measure=True).measured, Activations("full").measured
    (False, True, True)
    >>> Activations(checkpoint="some")
    Traceback (most recent call last):
    ...
    shardengine.errors.ConfigError: unknown checkpointing 'some'; choose from none, selective, full, every-k:K, selective:mm, selective:mm/2 (alias selective:op)
    """

    checkpoint: str = "none"
    offload: OffloadValue = False
    measure: bool = False

    def __post_init__(self) -> None:
        parse_checkpoint(self.checkpoint, ConfigError)
        _set(self, "offload", check_offload(self.offload, ConfigError))
        boolean("measure_activations", self.measure)

    @property
    def rule(self) -> CheckpointRule:
        return parse_checkpoint(self.checkpoint, ConfigError)

    @property
    def enabled(self) -> bool:
        """The engine changes what blocks keep (checkpointing) or where (offload)."""
        return self.checkpoint != "none" or self.offload is not False

    @property
    def measured(self) -> bool:
        """Training forwards count what they keep (saved-tensor hooks in place)."""
        return self.measure or self.enabled


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
        integer("compression block_size", self.block_size, minimum=1)
        integer("compression powersgd_rank", self.powersgd_rank, minimum=1)
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
