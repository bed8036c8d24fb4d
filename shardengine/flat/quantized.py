"""bitsandbytes-quantized weights (QLoRA bases) in flat buckets.

A bitsandbytes ``Linear4bit`` keeps its weight as a ``Params4bit``: the NF4/FP4 codes
packed two per byte (``ceil(numel / 2)`` bytes, shape ``(n, 1)``) with a ``quant_state``
attribute (the absmax per block of 64 values, itself quantized with double
quantization, the code book and the original shape). A ``Linear8bitLt`` keeps an
``Int8Params``: int8 codes of the original shape and ``SCB``, one fp32 scale per row.
The codes are ordinary tensors: stage 3 shards, gathers and frees them like any frozen
parameter. The quantization state stays whole on every rank beside the shard: 4-bit,
4 bytes per 64 values without double quantization (1/8 of the codes' bytes), about 1 per
64 with it (1/32); int8, 4 bytes per row (4 / in_features of the codes' bytes).
bitsandbytes' int8 matmul keeps its own copy of the codes; ``prepare_quantized`` gives
it a state that reads the gathered ones instead (flat/int8_state.py).

[Note: a quantized base on the meta device]
Declared on the meta device (transformers' ``replace_with_bnb_linear`` under
``torch.device("meta")``), such a weight has the original shape and a float dtype and no
quantization state yet. ``prepare_quantized`` gives it the shape and dtype of its codes
before the layout is planned, so each rank's shard is a shard of the codes; it records
the original shape and dtype, which ``se.load_pretrained`` reads from the checkpoint and
quantizes, one tensor at a time, with bitsandbytes' own functions (so every rank, and a
one-process ``from_pretrained``, gets the same codes and state bit for bit), keeping this
rank's slice of the codes. Until then the codes are zeros and the state is missing:
a forward is refused (by bitsandbytes for 4-bit, by flat/int8_state.py for int8).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError

_FOUR_BIT = "Params4bit"
_EIGHT_BIT = "Int8Params"
SOURCE = "_shardengine_source"  # attribute: (shape, dtype) of a meta weight still to quantize


def _kind(param: torch.Tensor) -> Optional[str]:
    """``Params4bit``, ``Int8Params`` or None, by class (bitsandbytes is never imported here; the
    engine's stage-3 parameters are subclasses of the user's classes)."""
    for cls in type(param).__mro__:
        if cls.__module__.startswith("bitsandbytes") and cls.__name__ in (_FOUR_BIT, _EIGHT_BIT):
            return cls.__name__
    return None


def is_quantized_weight(param: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit or 8-bit weight."""
    return _kind(param) is not None


def source_of(param: torch.Tensor) -> Optional[tuple[torch.Size, torch.dtype]]:
    """The original ``(shape, dtype)`` of a weight that ``se.load_pretrained`` quantizes, else None."""
    return getattr(param, SOURCE, None)


def prepare_quantized(model: nn.Module) -> None:
    """Before ``shard()`` plans the layout: meta weights take their codes' shape (see the Note),
    and quantized weights stop being replaced behind the engine's back."""
    for name, module in model.named_modules():
        if not type(module).__module__.startswith("bitsandbytes"):
            continue
        # [Note: bitsandbytes' CPU repacking] In eval mode without grad, Linear4bit repacks its
        # codes for AVX512-BF16 kernels and assigns them to weight.data; the engine's gathered
        # storage would be replaced and the next gather would fill the old layout under a state
        # that says "repacked". Off: the plain dequantize-and-matmul path gives the same numbers.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        weight = getattr(module, "weight", None)
        if weight is None or not is_quantized_weight(weight):
            continue
        if weight.is_meta and weight.dtype.is_floating_point:
            _declare_codes(weight)
        if _kind(weight) == _EIGHT_BIT:
            _check_int8(module, name)
            from .int8_state import install
            install(module, f"{name}.weight")


def _declare_codes(weight: nn.Parameter) -> None:
    setattr(weight, SOURCE, (weight.shape, weight.dtype))
    if _kind(weight) == _EIGHT_BIT:  # one int8 code per value; the scales come with the load
        weight.data = torch.empty(weight.shape, dtype=torch.int8, device="meta")
        weight.CB = weight.SCB = None
        return
    storage = weight.quant_storage
    count = (weight.numel() + 1) // (storage.itemsize * 2)  # bitsandbytes' quantize_4bit output
    weight.data = torch.empty((count, 1), dtype=storage, device="meta")


def _check_int8(module: nn.Module, name: str) -> None:
    """Only frozen int8 codes are sharded: ``has_fp16_weights=True`` (``llm_int8_has_fp16_weight``)
    keeps a trainable fp16 weight that bitsandbytes re-quantizes at every forward."""
    if module.state.has_fp16_weights or module.weight.requires_grad:
        raise ConfigError(f"{name} ({type(module).__name__}) keeps trainable 16-bit weights "
                          "(has_fp16_weights=True / llm_int8_has_fp16_weight=True): shardengine shards "
                          "frozen int8 bases only; keep the default llm_int8_has_fp16_weight=False")


def quantize(param: nn.Parameter, source: torch.Tensor) -> torch.Tensor:
    """The codes of ``source`` (the whole original weight, flattened) as bitsandbytes quantizes it
    when it loads a checkpoint; the quantization state is attached to ``param``. Flat codes."""
    import bitsandbytes.functional as bnb_functional

    shape, dtype = source_of(param)
    weight = source.reshape(shape).to(dtype).contiguous()
    if _kind(param) == _EIGHT_BIT:  # as Int8Params._quantize: row-wise absmax of the fp16 weight
        codes, param.SCB, _ = bnb_functional.int8_vectorwise_quant(weight.to(torch.float16))
        return codes.reshape(-1)
    codes, state = bnb_functional.quantize_4bit(weight, blocksize=param.blocksize,
                                                compress_statistics=param.compress_statistics,
                                                quant_type=param.quant_type, quant_storage=param.quant_storage)
    param.quant_state, param.bnb_quantized = state, True
    return codes.reshape(-1)


def meta_stand_in(param: nn.Parameter) -> nn.Parameter:
    """What an init rule sees of ``param`` while other units are initialized: a meta tensor of the
    original float shape for a weight still to quantize (rules such as ``normal_`` refuse int
    codes), else of its own shape."""
    shape, dtype = source_of(param) or (param.shape, param.dtype)
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad)


# --------------------------------------------------------------------------- stored pre-quantized

# [Note: a pre-quantized folder] ``save_pretrained`` of a bitsandbytes model stores each weight's
# codes under the weight's name and its state beside it: int8 as ``<module>.SCB`` (the row
# scales) and ``<module>.weight_format`` (0: row-major, the only layout bitsandbytes 0.50
# reads); 4-bit as ``<weight>.absmax``, ``.quant_map``, ``.nested_absmax``,
# ``.nested_quant_map`` and ``.quant_state.bitsandbytes__<type>`` (the rest, packed). A rank
# reads its slice of the codes and the whole state, which it keeps whole as after quantizing.
_ROW_MAJOR = 0


def stored_state_names(param: nn.Parameter, source: str, stored: Iterable[str]) -> dict[str, str]:
    """The stored tensors holding the quantization state of ``param``'s codes stored as ``source``,
    by their names' part after the module's (int8) or the weight's (4-bit) name."""
    prefix = source.rpartition(".")[0] + "." if _kind(param) == _EIGHT_BIT else source + "."
    wanted = ("SCB", "weight_format") if _kind(param) == _EIGHT_BIT else None
    return {name[len(prefix):]: name for name in stored
            if name.startswith(prefix) and (wanted is None or name[len(prefix):] in wanted)}


def required_state_parts(param: nn.Parameter) -> tuple[str, ...]:
    """The stored state without which ``param``'s stored codes cannot be dequantized."""
    return ("SCB",) if _kind(param) == _EIGHT_BIT else ("absmax", "quant_map")


def attach_stored_state(param: nn.Parameter, name: str, state: dict[str, torch.Tensor]) -> None:
    """Give ``param`` the quantization state read from a pre-quantized folder (``state``: by
    the stored names' part after the weight's or module's name, as bitsandbytes saved it)."""
    if _kind(param) == _EIGHT_BIT:
        if "SCB" not in state:
            raise CheckpointError(f"{name}: int8 codes are stored without their row scales (SCB)")
        layout = state.get("weight_format")
        if layout is not None and int(layout) != _ROW_MAJOR:
            raise CheckpointError(f"{name}: int8 codes stored in weight_format {int(layout)}; bitsandbytes "
                                  f"0.50 reads row-major ({_ROW_MAJOR}) only")
        param.SCB = state["SCB"].to(torch.float32)
        return
    from bitsandbytes.functional import QuantState
    try:
        quant_state = QuantState.from_dict(dict(state), device=torch.device("cpu"))
    except (ValueError, KeyError, AssertionError) as error:
        raise CheckpointError(f"{name}: the stored 4-bit quantization state does not load: {error}") from error
    # as bitsandbytes' Params4bit.from_prequantized: the stored settings win over the declared ones
    param.quant_state, param.bnb_quantized = quant_state, True
    param.blocksize, param.compress_statistics = quant_state.blocksize, quant_state.nested
    param.quant_type = quant_state.quant_type
