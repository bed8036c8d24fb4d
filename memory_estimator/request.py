"""What ``estimate()`` is asked: the model, how it is trained, by which engine, on which hardware.

[Note: typed requests, one flat vocabulary at the door]
An estimate depends on some forty choices. They are grouped by the question each part
answers — :class:`ModelRequest` (what the model is), :class:`TrainingRequest` (how it is
trained), :class:`FineTuningRequest` (which weights train, on what base),
:class:`EngineRequest` (whose memory model, with its knobs) and :class:`TargetRequest`
(the device and its overheads) — and held together by :class:`EstimateRequest`. The
estimator's pipeline reads these objects, never loose keywords.

The flat keyword names (``estimate(params=7e9, world_size=8, ...)``, the field files'
``"setup"`` objects) are kept as one vocabulary parsed in one place,
:meth:`EstimateRequest.from_keywords`: each keyword is a field of exactly one part
(:data:`KEYWORDS` says which), and an unknown one is a ``TypeError`` naming the part
that has the closest field, as Python reports an unknown keyword argument.

>>> request = EstimateRequest.from_keywords(params=7e9, world_size=8, device="H100-80GB")
>>> request.model.params, request.training.world_size, request.target.device
(7000000000.0, 8, 'H100-80GB')
>>> request.replaced(seq_len=4096).training.seq_len
4096
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from .engines.shardengine_exact import EngineOptions
from .hardware.calibration import Calibration
from .model.module import ExampleInputs, ModuleSource
from .terms.overheads import Overheads
from .byte_units import MiB

__all__ = ["ModelRequest", "TrainingRequest", "FineTuningRequest", "EngineRequest", "TargetRequest",
           "EstimateRequest", "KEYWORDS"]


@dataclass(frozen=True)
class ModelRequest:
    """What the model is: exactly one of ``params`` (a count), ``config`` (a HF-style config.json
    path or dict) or ``module`` (an ``nn.Module``, a zero-argument factory, ``"pkg.mod:fn"`` or
    ``"path/to/file.py:fn"``). ``example_inputs(micro_batch, seq_len)`` traces a module's
    activations on fake tensors; ``hidden/layers/heads/vocab`` give a count's activations."""

    params: int | float | None = None
    config: str | Path | Mapping[str, Any] | None = None
    module: ModuleSource | None = None
    example_inputs: ExampleInputs | None = None
    largest_layer: int | float | None = None
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    vocab: int | None = None


@dataclass(frozen=True)
class TrainingRequest:
    """How the model is trained: ranks, precision, optimizer, batch shape, checkpointing, kernels.

    ``precision`` None picks bf16 (fp32 under ``amp``, or a DeepSpeed config's); ``micro_batch``
    None picks 1 (or a DeepSpeed config's); ``optimizer`` is a name or a live ``torch.optim``
    instance; ``proportions`` (one share per rank) split the global micro-batch unevenly.
    ``loss_upcast``: whether a plain loss upcasts 16-bit logits to fp32 (None: not stated, a
    range). ``kernels``: kernel families (``liger``, ``unsloth``, ``flash-attn-fused``, ...,
    ``terms/kernel_families.py``). Varying lengths: ``mean_seq_len`` (mean padded batch) or
    ``length_histogram`` (sequence lengths: a file or ``{length: count}``; ``over_cap``
    ``truncate`` or ``drop``), over ``steps`` micro-steps, ``expandable_segments`` as torch's
    allocator option (``allocator/``)."""

    world_size: int = 1
    precision: str | None = None
    amp: str | None = None
    optimizer: Any = "adamw"
    optimizer_impl: str | None = None
    micro_batch: int | None = None
    seq_len: int = 2048
    checkpointing: str = "none"
    fused_attention: bool = True
    zero_grad_to_none: bool = True
    proportions: Sequence[float] | None = None
    grad_accum: int = 1
    optimizer_in_backward: bool = False
    activation_offload: bool = False
    loss: str = "plain"
    fused_norm: bool = False
    compile: bool = False
    loss_upcast: bool | None = None
    kernels: str | Sequence[str] | None = None
    # Varying lengths (allocator/lengths.py): seq_len is then their cap.
    mean_seq_len: float | None = None
    length_histogram: str | Path | Mapping[int, float] | None = None
    over_cap: str = "truncate"
    steps: int | None = None
    expandable_segments: bool = False


@dataclass(frozen=True)
class FineTuningRequest:
    """Which weights train: LoRA adapters (``lora_rank``, ``lora_targets``) or ``trainable_params``
    on a frozen base stored in ``base_dtype``; all None is full training."""

    lora_rank: int | None = None
    lora_targets: str | Sequence[str] | None = None
    trainable_params: int | float | None = None
    base_dtype: str | None = None
    lora_dropout: float = 0.0
    quantizer: str = "bitsandbytes"


@dataclass(frozen=True)
class EngineRequest:
    """Whose memory is modelled and its knobs: ``name`` shardengine (``options`` carries
    ``shard()``'s; ``offload_params`` a fraction, or ``offload_device_budget`` bytes or "8GiB",
    adds its fractional offload plan; ``disk`` plans its disk tier too; ``reshard_after_forward=False``
    its stage 3 keeping every unit gathered from forward to backward), ddp (``gradient_as_bucket_view``), fsdp2
    (``reduce_dtype``) or deepspeed (``deepspeed_config``, a ds_config.json path or dict)."""

    name: str = "shardengine"
    options: EngineOptions | None = None
    deepspeed_config: str | Path | Mapping[str, Any] | None = None
    reduce_dtype: str | None = None
    gradient_as_bucket_view: bool = False
    prefetch_depth: int = 1
    reshard_after_forward: bool = True
    bucket_bytes: int = 25 * MiB
    shard_numel_per_rank: int | None = None
    offload_params: float | None = None
    offload_device_budget: int | str | None = None
    disk: bool = False


@dataclass(frozen=True)
class TargetRequest:
    """The hardware: a catalog ``device`` (or ``"this-machine"``) or ``device_memory_bytes``, the
    overheads (None: the device's defaults, or a ``calibration`` file's measured ones), and the
    fraction of memory kept free. A node's ``host_memory_bytes`` and ``disk_space_bytes`` (bytes,
    or "128GiB"; None: this machine's for ``"this-machine"``, else not stated) and its
    ``ranks_per_node`` (None: the device's usual node) judge what offload plans keep off the
    device; ``offload_path`` is where the disk tier writes (its free space, on this machine)."""

    device: str | None = "A100-80GB"
    device_memory_bytes: int | str | None = None
    overheads: Overheads | None = None
    calibration: str | Path | Calibration | None = None
    safety_margin: float = 0.10
    module_loading: str = "lazy"
    host_memory_bytes: int | str | None = None
    disk_space_bytes: int | str | None = None
    ranks_per_node: int | None = None
    offload_path: str | None = None


# The flat keyword -> (part, field) of the request; two keywords are renamed in their part.
_RENAMED = {"engine": ("engine", "name"), "engine_options": ("engine", "options")}
_PARTS = {"model": ModelRequest, "training": TrainingRequest, "fine_tuning": FineTuningRequest,
          "engine": EngineRequest, "target": TargetRequest}
KEYWORDS: dict[str, tuple[str, str]] = {
    **{f.name: (part, f.name) for part, kind in _PARTS.items() for f in fields(kind)
       if (part, f.name) not in _RENAMED.values()},
    **_RENAMED,
}


@dataclass(frozen=True)
class EstimateRequest:
    """One question for ``estimate()``: the model, its training, fine-tuning, engine and target."""

    model: ModelRequest = field(default_factory=ModelRequest)
    training: TrainingRequest = field(default_factory=TrainingRequest)
    fine_tuning: FineTuningRequest = field(default_factory=FineTuningRequest)
    engine: EngineRequest = field(default_factory=EngineRequest)
    target: TargetRequest = field(default_factory=TargetRequest)

    @classmethod
    def from_keywords(cls, **keywords: Any) -> "EstimateRequest":
        """The request the flat keywords ask for (every other field at its default)."""
        return cls().replaced(**keywords)

    def replaced(self, **keywords: Any) -> "EstimateRequest":
        """This request with the named flat keywords changed (``replaced(seq_len=4096)``)."""
        changes: dict[str, dict[str, Any]] = {}
        for keyword, value in keywords.items():
            if keyword not in KEYWORDS:
                raise TypeError(_unknown(keyword))
            part, name = KEYWORDS[keyword]
            changes.setdefault(part, {})[name] = value
        return replace(self, **{part: replace(getattr(self, part), **values) for part, values in changes.items()})


def _unknown(keyword: str) -> str:
    close = difflib.get_close_matches(keyword, KEYWORDS, n=1)
    hint = f" (did you mean {close[0]!r}, a field of {_PARTS[KEYWORDS[close[0]][0]].__name__}?)" if close else ""
    return (f"estimate() got an unexpected keyword argument {keyword!r}{hint}; its keywords are the fields of "
            f"{', '.join(kind.__name__ for kind in _PARTS.values())}")
