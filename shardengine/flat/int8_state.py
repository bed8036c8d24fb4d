"""bitsandbytes' int8 matmul state, reading the engine's gathered codes.

Imported by ``flat/quantized.py`` only when a model holds a ``Linear8bitLt`` (so bitsandbytes
is already imported); the engine itself never imports bitsandbytes.

[Note: int8 codes gathered for the matmul]
``Linear8bitLt`` hands its matmul a ``MatmulLtState`` whose ``CB`` (int8 codes, one row per
output) and ``SCB`` (one fp32 scale per row) are taken from the weight at the first forward
and kept: the state holds the whole codes for good, and after every forward the module
points ``weight.data`` back at them, away from the engine's flat buffer. At stage 3 the codes
exist whole only while their unit is gathered, so this state keeps no codes of its own:
``CB`` reads the weight's current storage (gathered by the engine for forward, for a
checkpointed recomputation and for backward, where ``MatMul8bitFp`` reads ``CB`` again for
the input gradient) and ``SCB`` the weight's scales. The scales stay whole on every rank
beside the sharded codes, as the 4-bit quantization state does: 4 bytes per row of
``in_features`` code bytes (0.1% at 4096 inputs), and every rank needs all of them when the
unit is gathered. Values are bitsandbytes' own, so the forward (and the outlier path of
``MatMul8bitLt`` under ``no_grad`` with the default threshold 6.0) computes exactly what a
one-process ``Linear8bitLt`` computes.
"""

from __future__ import annotations

from typing import Optional

import bitsandbytes as bnb
import torch

from ..errors import ConfigError


class GatheredInt8State(bnb.MatmulLtState):
    """A ``MatmulLtState`` whose ``CB`` / ``SCB`` are the weight's gathered codes and its scales."""

    def __init__(self, like: bnb.MatmulLtState, weight: torch.nn.Parameter, name: str):
        self._weight = weight
        self._name = name
        super().__init__()  # dataclass defaults (assigns CB = SCB = None: ignored below)
        self.__dict__.update({k: v for k, v in vars(like).items() if k not in ("CB", "SCB")})

    @property
    def CB(self) -> Optional[torch.Tensor]:  # noqa: N802 - bitsandbytes' name
        """The codes as the weight holds them now (the whole matrix while its unit is gathered);
        None until the scales are loaded, which bitsandbytes reads as "quantize the weight"."""
        weight = self.__dict__.get("_weight")
        return None if weight is None or weight.SCB is None else weight.data

    @CB.setter
    def CB(self, value: Optional[torch.Tensor]) -> None:  # noqa: N802
        if value is not None:  # bitsandbytes quantizing the weight itself: it holds codes already
            raise ConfigError(f"the int8 weight {self._name} has no scales yet: load it with "
                              "se.load_pretrained(model, folder) before running the model")

    @property
    def SCB(self) -> Optional[torch.Tensor]:  # noqa: N802
        weight = self.__dict__.get("_weight")
        return None if weight is None else weight.SCB

    @SCB.setter
    def SCB(self, value: Optional[torch.Tensor]) -> None:  # noqa: N802
        if value is not None:  # Linear8bitLt._load_from_state_dict hands the weight's own scales back
            self._weight.SCB = value


def install(module: torch.nn.Module, name: str) -> None:
    """Give ``module`` (a ``Linear8bitLt``) a state that reads its weight's gathered codes, its
    scales kept on the weight (whole) and its own copy of the codes dropped."""
    weight, state = module.weight, module.state
    if isinstance(state, GatheredInt8State):
        return
    scales = weight.SCB if weight.SCB is not None else state.SCB
    weight.CB, weight.SCB = None, scales  # CB: the whole codes; the engine holds them from now on
    module.state = GatheredInt8State(state, weight, name)
