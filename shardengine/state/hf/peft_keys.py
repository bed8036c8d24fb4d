"""A PEFT model's frozen base, named as the base's own checkpoint names it.

``peft.get_peft_model`` renames the base's tensors: everything moves under
``base_model.model.``, a targeted layer's weight under ``.base_layer.``
(``model.layers.0.self_attn.q_proj.weight`` becomes
``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``), and a
``modules_to_save`` layer exists twice (``.original_module.`` and
``.modules_to_save.<adapter>.``, both copies of the base's). Loading a base
checkpoint into a PEFT model maps the names back; the adapters themselves are
not in a base checkpoint and keep their initialization. Pure code apart from
looking at the module tree; peft is only looked at when it is imported.

>>> base_key("base_model.model.model.layers.0.q_proj.base_layer.weight", "base_model.model.")
'model.layers.0.q_proj.weight'
>>> base_key("base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.")
'lm_head.weight'
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Optional

from torch import nn

_WRAPPER_SEGMENTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


@dataclass(frozen=True)
class PeftBase:
    """The base model inside a PEFT model, and what in the PEFT model is not the base."""

    model: nn.Module            # the wrapped model (a transformers PreTrainedModel, usually)
    prefix: str                 # its key prefix in the PEFT model: "base_model.model."
    adapters: frozenset[int]    # id() of the adapter tensors (LoRA A and B, ...)

    def key(self, peft_key: str) -> Optional[str]:
        """The base checkpoint's name for a PEFT model key; None outside the base."""
        return base_key(peft_key, self.prefix)

    def __str__(self) -> str:
        return (f"PEFT base under '{self.prefix}' ('.base_layer' dropped; "
                f"{len(self.adapters)} adapter tensors keep their initialization)")


def base_key(peft_key: str, prefix: str) -> Optional[str]:
    """``peft_key`` without the PEFT prefix and wrapper segments; None when not under ``prefix``."""
    if not peft_key.startswith(prefix):
        return None
    return _WRAPPER_SEGMENTS.sub("", peft_key[len(prefix):])


def peft_base(module: nn.Module) -> Optional[PeftBase]:
    """The base inside ``module`` when it is a ``peft.PeftModel``, else None."""
    peft = sys.modules.get("peft")
    peft_model = getattr(peft, "PeftModel", None)
    if peft_model is None or not isinstance(module, peft_model):
        return None
    inner = getattr(module.base_model, "model", None)
    if not isinstance(inner, nn.Module):
        return None
    prefix = next(name for name, m in module.named_modules() if m is inner) + "."
    return PeftBase(inner, prefix, frozenset(_adapter_tensor_ids(module)))


def _adapter_tensor_ids(module: nn.Module) -> set[int]:
    """Tensors held by peft's tuner layers in their adapter containers (not their base layer)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    layer_class = getattr(tuners, "BaseTunerLayer", None)
    ids: set[int] = set()
    for layer in module.modules():
        if layer_class is None or not isinstance(layer, layer_class):
            continue
        for attribute in tuple(layer.adapter_layer_names) + tuple(layer.other_param_names):
            container = getattr(layer, attribute, None)
            if isinstance(container, nn.Module):
                ids.update(id(t) for t in container.parameters())
                ids.update(id(t) for t in container.buffers())
    return ids
