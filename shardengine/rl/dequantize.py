"""A bitsandbytes base streamed dequantized: the codes gathered, then bitsandbytes' own dequantization.

A rollout engine loading a checkpoint expects float weights under the weight's name
(what ``model.dequantize()`` gives), not the NF4/int8 codes with their quantization
state beside them. The codes are sharded like any frozen parameter
(flat/quantized.py); the state (4-bit: absmax per block, code book, shape; int8: one
scale per row) stays whole on every rank, so a bucket gathers the codes and
dequantizes them with ``bitsandbytes.functional.dequantize_4bit`` /
``int8_vectorwise_dequant``: the values a one-process bitsandbytes model dequantizes to.
bitsandbytes is imported only when a model holds such a weight.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..flat.quantized import is_quantized_weight


def quantized_bits(param: torch.Tensor) -> Optional[int]:
    """4 for a ``Params4bit``, 8 for an ``Int8Params``, else None."""
    if not is_quantized_weight(param):
        return None
    return 4 if any(cls.__name__ == "Params4bit" for cls in type(param).__mro__) else 8


def dequantized_shape(param: torch.Tensor, code_shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
    """The float weight's shape and the dtype bitsandbytes dequantizes it to."""
    if quantized_bits(param) == 4:
        state = param.quant_state
        return tuple(state.shape), state.dtype
    return tuple(code_shape), torch.float32


def dequantize(param: torch.Tensor, codes: torch.Tensor, code_shape: tuple[int, ...]) -> torch.Tensor:
    """``param``'s float weight from its gathered ``codes`` (flat), with its quantization state."""
    import bitsandbytes.functional as bnb_functional

    codes = codes.view(code_shape)
    if quantized_bits(param) == 4:
        return bnb_functional.dequantize_4bit(codes, param.quant_state)
    return bnb_functional.int8_vectorwise_dequant(codes, param.SCB.to(codes.device))


def dequantize_scratch_bytes(param: torch.Tensor, numel: int) -> int:
    """What :func:`dequantize` allocates for ``numel`` weights beyond its output: 4-bit with double
    quantization first dequantizes the block scales (one fp32 per block) and adds their offset."""
    if quantized_bits(param) != 4 or not getattr(param.quant_state, "nested", False):
        return 0
    blocks = -(-numel // param.quant_state.blocksize)
    return 2 * blocks * 4
