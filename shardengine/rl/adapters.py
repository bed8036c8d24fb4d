"""PEFT LoRA adapters merged into the streamed weights, as peft's ``merge_and_unload()`` merges them.

[Note: merged as peft merges]
A rollout engine wants the merged weights ``W + scale * B @ A`` under the base model's names
(what ``merge_and_unload()`` returns), while the trainer keeps W, A and B apart and
untouched. Each merged weight is computed in its bucket from the gathered W, A and B with
peft's own arithmetic (``LoraLayer.get_delta_weight``: B @ A in the adapters' dtype, in
fp32 on CPU for a 16-bit adapter, transposed for ``fan_in_fan_out`` and embeddings, times
the scale, cast back; then ``W += delta`` in W's dtype), in the training values' dtypes,
so the result is bit for bit ``merge_and_unload()`` of the same model holding
``full_state_dict()``; only then is it cast to the stream's dtype. A 4-bit or 8-bit base
is dequantized first and the delta added as peft's bitsandbytes layers add it (without
quantizing the sum again: the rollout gets the merged weight itself).

Names: the ``base_model.model.`` prefix goes, ``<layer>.base_layer.<x>`` becomes
``<layer>.<x>``, the ``lora_*`` tensors are not streamed, and a ``modules_to_save``
wrapper streams its active copy under the wrapped module's names (the original dropped).
Variants peft merges differently (DoRA, ``lora_bias``) and layers it merges by convolution
are refused: nothing here guesses at a formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from .dequantize import quantized_bits

_ADAPTER_TENSORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_PEFT_ROOT_PREFIX = "base_model.model."


def _peft_class(module: nn.Module, name: str) -> bool:
    return any(cls.__name__ == name and cls.__module__.startswith("peft") for cls in type(module).__mro__)


def is_peft_model(module: nn.Module) -> bool:
    """A peft ``PeftModel`` (or a model holding peft's LoRA layers)."""
    return _peft_class(module, "PeftModel") or any(_peft_class(m, "LoraLayer") for m in module.modules())


@dataclass(frozen=True)
class Adapter:
    """One adapter to add to a base weight: ``delta = transpose(B @ A) * scale`` as peft computes it."""

    a: nn.Parameter
    b: nn.Parameter
    scale: float
    transposed: bool   # fan_in_fan_out (Conv1D), or an embedding (peft always transposes those)
    embedding: bool    # peft takes an embedding adapter's dtype from A, a linear one's from B

    def delta(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """peft's ``get_delta_weight`` over the gathered values ``a``, ``b`` (their dtypes are the
        adapters' training dtypes: what ``full_state_dict()`` holds). The scale is applied in
        place, which gives the same elements as peft's ``product * scale``."""
        dtype = (a if self.embedding else b).dtype
        upcast = a.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
        if upcast:  # as peft: CPUs are slow at 16-bit matmuls, so it merges in fp32 there
            a, b = a.float(), b.float()
        product = b @ a
        product.mul_(self.scale)
        if self.transposed:
            product = product.T
        return product.to(dtype) if upcast else product

    def transient_bytes(self, numel: int, a_dtype: torch.dtype, b_dtype: torch.dtype) -> int:
        """The most bytes :meth:`delta` holds at once for a weight of ``numel`` elements."""
        dtype = a_dtype if self.embedding else b_dtype
        if dtype in (torch.float16, torch.bfloat16):  # upcast on CPU: fp32 product, then its cast
            return numel * (4 + dtype.itemsize) + 4 * (self.a.numel() + self.b.numel())
        return numel * dtype.itemsize


@dataclass(frozen=True)
class MergedWeight:
    """A base weight and the adapters merged into it; ``bits`` 4 or 8 for a bitsandbytes base (the
    sum is then formed as peft's bitsandbytes layers form it)."""

    adapters: tuple[Adapter, ...]
    bits: Optional[int] = None

    def apply(self, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``base`` (dequantized for a quantized base) plus one adapter's delta, as peft adds it."""
        if self.bits == 4:
            return base + delta
        if self.bits == 8:
            return base.to(delta.dtype) + delta
        base += delta  # peft: base_layer.weight.data += delta_weight (W keeps its dtype)
        return base


class LoraNames:
    """The merged model's names for a peft model's state-dict keys, and which weights take which adapters."""

    def __init__(self, root: nn.Module) -> None:
        self.prefix = _PEFT_ROOT_PREFIX if _peft_class(root, "PeftModel") else ""
        self.lora_layers: dict[str, nn.Module] = {}
        self.saved: dict[str, str] = {}  # modules_to_save wrapper path -> its active adapter
        for path, module in root.named_modules():
            if _peft_class(module, "LoraLayer"):
                self.lora_layers[path] = module
            elif _peft_class(module, "ModulesToSaveWrapper"):
                self.saved[path] = _single_active(module, path)
            elif _peft_class(module, "BaseTunerLayer") or _peft_class(module, "AuxiliaryTrainingWrapper"):
                raise ConfigError(f"{path} is a {type(module).__name__}: streaming merged weights supports peft's "
                                  "LoRA layers (and modules_to_save) only; stream with merge_adapters=False to "
                                  "get the adapter tensors unmerged")

    def rename(self, key: str) -> Optional[str]:
        """The merged model's name for state-dict ``key``, or None when the merged model has no such tensor."""
        parts = key.split(".")
        out: list[str] = []
        index = 0
        while index < len(parts):
            path = ".".join(parts[:index])
            if path in self.lora_layers:
                if parts[index] in _ADAPTER_TENSORS:
                    return None
                if parts[index] == "base_layer":
                    index += 1
                    continue
            if path in self.saved:
                if parts[index] == "original_module":
                    return None
                if parts[index] == "modules_to_save":
                    if index + 1 >= len(parts) or parts[index + 1] != self.saved[path]:
                        return None
                    index += 2
                    continue
            out.append(parts[index])
            index += 1
        name = ".".join(out)
        return name.removeprefix(self.prefix) if self.prefix else name

    def merges(self) -> dict[int, MergedWeight]:
        """``id(base weight) -> MergedWeight`` for every LoRA layer with an adapter to merge."""
        merged = {}
        for path, layer in self.lora_layers.items():
            adapters = tuple(_adapter(layer, name, path) for name in _to_merge(layer))
            if adapters:
                weight = layer.get_base_layer().weight
                merged[id(weight)] = MergedWeight(adapters, quantized_bits(weight))
        return merged


def _single_active(wrapper: nn.Module, path: str) -> str:
    active = wrapper.active_adapters if hasattr(wrapper, "active_adapters") else [wrapper.active_adapter]
    active = [active] if isinstance(active, str) else list(active)
    if len(active) != 1:
        raise ConfigError(f"{path}: modules_to_save with {len(active)} active adapters; merge_and_unload keeps one")
    return active[0]


def _to_merge(layer: nn.Module) -> list[str]:
    """The adapters ``merge_and_unload()`` adds to this layer: active, not merged already."""
    merged = set(getattr(layer, "merged_adapters", []))
    present = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))
    return [name for name in layer.active_adapters if name in present and name not in merged]


def _adapter(layer: nn.Module, name: str, path: str) -> Adapter:
    if name in getattr(layer, "lora_variant", {}):
        variant = type(layer.lora_variant[name]).__name__
        raise ConfigError(f"{path}: adapter {name!r} is a {variant} (DoRA or another LoRA variant), which peft "
                          "merges by its own formula; stream with merge_adapters=False, or merge it with peft")
    if getattr(layer, "lora_bias", {}).get(name, False):
        raise ConfigError(f"{path}: adapter {name!r} has lora_bias=True; streaming merged weights supports "
                          "plain LoRA only (merge_adapters=False streams it unmerged)")
    scale = float(layer.scaling[name])
    if name in getattr(layer, "lora_embedding_A", {}):
        return Adapter(layer.lora_embedding_A[name], layer.lora_embedding_B[name], scale, True, True)
    a_module, b_module = layer.lora_A[name], layer.lora_B[name]
    if not isinstance(a_module, nn.Linear) or not isinstance(b_module, nn.Linear):
        raise ConfigError(f"{path}: adapter {name!r} is a {type(a_module).__name__} (a convolution or another "
                          "layer peft merges by its own formula); streaming merged weights supports LoRA on "
                          "linear and embedding layers")
    return Adapter(a_module.weight, b_module.weight, scale, bool(getattr(layer, "fan_in_fan_out", False)), False)
