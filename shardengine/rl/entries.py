"""What a weight stream yields: one entry per output tensor, named as the rollout model names it.

An :class:`Entry` is one tensor of the output (a tied weight is one entry under several
names), the inputs that must be gathered to form it, and how: most entries are their only
input, cast on the way (it lands in the output itself); a bitsandbytes weight is its
gathered codes dequantized (dequantize.py); a LoRA base weight is W plus each adapter's
delta, as peft merges it (adapters.py). :func:`build_entries` walks the wrapped module's
``state_dict`` (the order and the names ``load_state_dict`` uses) and says where each
tensor's values come from (sources.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..engine_api import Engine
from ..flat import guard
from .adapters import LoraNames, MergedWeight, is_peft_model
from .dequantize import dequantize, dequantize_scratch_bytes, dequantized_shape, quantized_bits
from .sources import LocalSource, SlotSource, Source


@dataclass(frozen=True)
class Input:
    """One tensor gathered for an entry, travelling in ``dtype``."""

    source: Source
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.source.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Entry:
    """One output tensor: its names, shape and streamed dtype, and how it is formed from its inputs.

    ``inputs[0]`` is the weight (the codes of a quantized one), then A and B per merged
    adapter. ``direct``: ``inputs[0]`` arrives in the output itself, in the output's dtype
    (merging, if any, then adds to it in place).
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    inputs: tuple[Input, ...]
    direct: bool
    quantized: Optional[nn.Parameter] = None  # the bitsandbytes weight whose codes inputs[0] holds
    merge: Optional[MergedWeight] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def staged(self) -> tuple[Input, ...]:
        """The inputs that need a buffer of their own (not landing in the output)."""
        return self.inputs[1:] if self.direct else self.inputs

    @property
    def transient_bytes(self) -> int:
        """The most bytes :meth:`form` allocates at once beyond the output and the staged inputs."""
        held = 0
        if self.quantized is not None:  # the dequantized weight (at most fp32) and its scratch
            held += self.numel * 4 + dequantize_scratch_bytes(self.quantized, self.numel)
        if self.merge is not None:
            adapters = zip(self.merge.adapters, self.inputs[1::2], self.inputs[2::2])
            held += max(adapter.transient_bytes(self.numel, a.dtype, b.dtype) for adapter, a, b in adapters)
            held += self.numel * 4 if self.quantized is not None else 0  # peft forms the sum as a new tensor
        return held

    @property
    def cost(self) -> int:
        """Bytes this entry holds at its peak in a bucket: output, staged inputs, transients."""
        return self.nbytes + sum(i.nbytes for i in self.staged) + self.transient_bytes

    def form(self, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        """Write the output from the gathered ``inputs`` (flat tensors; ``inputs[0]`` is a view of
        ``out`` when ``direct``)."""
        if self.quantized is None and self.merge is None:
            if not self.direct:
                out.copy_(inputs[0])
            return
        weight = inputs[0]
        if self.quantized is not None:
            weight = dequantize(self.quantized, weight, self.inputs[0].source.shape)
        else:
            weight = weight.view(self.shape)
        if self.merge is not None:
            adapters = zip(self.merge.adapters, inputs[1::2], self.inputs[1::2], inputs[2::2], self.inputs[2::2])
            for adapter, a, a_input, b, b_input in adapters:
                delta = adapter.delta(a.view(a_input.source.shape), b.view(b_input.source.shape))
                weight = self.merge.apply(weight, delta)
                del delta
        if not (self.direct and weight.data_ptr() == out.data_ptr()):
            out.copy_(weight.reshape(-1))


def build_entries(engine: Engine, dtype: Optional[torch.dtype], merge_adapters: bool = True,
                  buffers: bool = True, tied_once: bool = False) -> list[Entry]:
    """The stream's entries for the engine's module, in ``state_dict`` order.

    ``dtype`` None keeps each tensor's training dtype. ``merge_adapters``: a peft model's LoRA
    weights merged under the base model's names (else its own keys, adapters apart).
    ``buffers``: persistent buffers too (else parameters only). ``tied_once``: a tied weight
    under its first name only (inference engines' ``load_weights`` want it once).
    """
    module = engine.module
    with guard.engine_access():
        state = module.state_dict(keep_vars=True)
        buffer_ids = {id(b) for b in module.buffers()}
        known = {id(p) for p in module.parameters()} | buffer_ids
    slot_of = {id(p): SlotSource(bucket, i) for bucket in engine.buckets for i, p in enumerate(bucket.params)}
    lora = LoraNames(module) if merge_adapters and is_peft_model(module) else None
    merges = lora.merges() if lora is not None else {}
    quantized_modules = [path for path, m in module.named_modules()
                         if isinstance(getattr(m, "weight", None), torch.Tensor) and quantized_bits(m.weight)]
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for key, tensor in state.items():
        if not torch.is_tensor(tensor) or (id(tensor) not in known and _owned_by(key, quantized_modules)):
            continue  # a quantized module's state (absmax, scales): the weight is streamed dequantized
        if not buffers and id(tensor) in buffer_ids:
            continue
        name = lora.rename(key) if lora is not None else key
        if name is not None:
            names.setdefault(id(tensor), []).append(name)
            tensors[id(tensor)] = tensor
    return [_entry(tuple(keys[:1] if tied_once else keys), tensors[tid], slot_of, merges, dtype)
            for tid, keys in names.items()]


def _owned_by(key: str, module_paths: list[str]) -> bool:
    return any(key.startswith(path + ".") for path in module_paths)


def _source(tensor: torch.Tensor, slot_of: dict[int, SlotSource]) -> Source:
    return slot_of.get(id(tensor)) or LocalSource(tensor.detach())


def _entry(names: tuple[str, ...], tensor: torch.Tensor, slot_of: dict[int, SlotSource],
           merges: dict[int, MergedWeight], dtype: Optional[torch.dtype]) -> Entry:
    source = _source(tensor, slot_of)
    merge = merges.get(id(tensor))
    bits = quantized_bits(tensor)
    quantized = tensor if bits is not None else None
    if bits is not None:
        shape, base_dtype = dequantized_shape(tensor, source.shape)
    else:
        shape, base_dtype = source.shape, source.training_dtype
    adapter_inputs: tuple[Input, ...] = ()
    if merge is not None:
        for adapter in merge.adapters:
            a, b = _source(adapter.a, slot_of), _source(adapter.b, slot_of)
            adapter_inputs += (Input(a, a.training_dtype), Input(b, b.training_dtype))
        if bits == 4:
            base_dtype = torch.promote_types(base_dtype, adapter_inputs[1].dtype)
        elif bits == 8:
            base_dtype = adapter_inputs[1].dtype
    out_dtype = dtype or base_dtype
    if quantized is None and merge is None:
        return Entry(names, shape, out_dtype, (Input(source, out_dtype),), direct=True)
    direct = quantized is None and source.training_dtype == out_dtype
    first = Input(source, source.training_dtype)
    return Entry(names, shape, out_dtype, (first,) + adapter_inputs, direct, quantized, merge)
