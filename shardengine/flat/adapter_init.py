"""PEFT LoRA adapters on a meta-device base, initialized at stage 3 exactly as ``get_peft_model`` does.

[Note: the adapters' values on a meta base]
``peft.get_peft_model`` on a meta-device base creates the adapters and moves
them to meta: their values are lost, so the engine draws them again. It does
so with peft's own code, in peft's order: for every LoRA layer in module
order and every adapter of it, the two ``nn.Linear`` constructions (``A``,
then ``B``: torch's default init, as ``update_layer`` builds them), then
``reset_lora_parameters(adapter, init_lora_weights)`` (kaiming-uniform ``A``
and zero ``B`` by default, ``"gaussian"``: normal ``A`` with std ``1/r``;
``False`` keeps the constructions' values). The draws come from the default
generator as it is when :func:`shardengine.shard` starts, forked (the caller's
generator does not advance), and rank 0's values are broadcast with their
unit. So ``torch.manual_seed(s)`` right before ``se.shard(...)`` gives the
adapters that ``torch.manual_seed(s)`` right before ``get_peft_model`` gives
on a real base: bit for bit, on every rank.

All adapters are drawn up front (a unit may come before the layer that, in
module order, precedes it) and held until their unit is materialized: the
adapters' bytes once, on top of one unit. Inits that read the base weights
(PiSSA, OLoRA, LoftQ, EVA, CorDA, DoRA's magnitude) cannot run on meta and are
refused, as are ``"orthogonal"`` (drawn outside ``reset_lora_parameters``) and
adapter types other than LoRA on linear layers.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import nn

from ..errors import ConfigError

SUPPORTED_INITS = (True, False, "gaussian")


def meta_lora_layers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The LoRA layers (peft's ``LoraLayer``) below ``root`` holding an adapter tensor on meta."""
    lora = sys.modules.get("peft.tuners.lora")
    layer_class = getattr(lora, "LoraLayer", None)
    if layer_class is None:
        return []
    return [(name, module) for name, module in root.named_modules()
            if isinstance(module, layer_class) and any(p.is_meta for p in _adapter_params(module))]


def draw_adapters(root: nn.Module) -> dict[int, torch.Tensor]:
    """``id(adapter parameter) -> its value`` for every LoRA adapter on meta below ``root``
    (see [Note: the adapters' values on a meta base]); empty when there is none."""
    layers = meta_lora_layers(root)
    if not layers:
        return {}
    configs = getattr(root, "peft_config", None) or {}
    for name, layer in layers:
        _check_drawable(name, layer, configs)
    values: dict[int, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for _, layer in layers:
            for adapter in layer.lora_A.keys():
                values.update(_draw_one(layer, adapter, configs[adapter].init_lora_weights))
    return values


def _adapter_params(layer: nn.Module) -> list[nn.Parameter]:
    params = []
    for attribute in layer.adapter_layer_names + layer.other_param_names:
        container = getattr(layer, attribute, None)
        if isinstance(container, nn.Module):
            params += list(container.parameters())
    return params


def _check_drawable(name: str, layer: nn.Module, configs: dict) -> None:
    """Refuse, naming the layer, what cannot be drawn without the base's values."""
    problems = []
    for adapter in set(layer.lora_A.keys()) | set(getattr(layer, "lora_embedding_A", {}).keys()):
        config = configs.get(adapter)
        init = getattr(config, "init_lora_weights", None)
        if config is None:
            problems.append(f"adapter {adapter!r} has no LoraConfig on the model")
        elif layer.use_dora.get(adapter, False):
            problems.append(f"adapter {adapter!r} uses DoRA (its magnitude is the base weight's norm)")
        elif init not in SUPPORTED_INITS:
            problems.append(f"adapter {adapter!r} has init_lora_weights={init!r}, which reads the base weights "
                            "or data, or is not drawn by reset_lora_parameters")
    if getattr(layer, "lora_embedding_A", None) and len(layer.lora_embedding_A):
        problems.append("LoRA on an embedding layer")
    if not problems and not all(isinstance(layer.lora_A[a], nn.Linear) and isinstance(layer.lora_B[a], nn.Linear)
                                for a in layer.lora_A.keys()):
        problems.append(f"LoRA on {type(layer).__name__} (only LoRA on linear layers is drawn on meta)")
    if problems:
        raise ConfigError(
            f"stage 3 cannot initialize the LoRA layer {name} on a meta-device base: {'; '.join(problems)}. "
            "Supported there: LoRA on linear layers with init_lora_weights=True, 'gaussian' or False. "
            "Otherwise load the base on CPU (from_pretrained) before get_peft_model")


def _draw_one(layer: nn.Module, adapter: str, init) -> dict[int, torch.Tensor]:
    """One adapter's values, drawn as ``update_layer`` draws them (see the Note)."""
    a_module, b_module = layer.lora_A[adapter], layer.lora_B[adapter]
    params = [p for module in (a_module, b_module) for p in module.parameters()]
    with _real_for_a_moment(params):
        a_module.reset_parameters()  # nn.Linear(in, r) as constructed
        b_module.reset_parameters()  # nn.Linear(r, out)
        layer.reset_lora_parameters(adapter, init)
        return {id(p): p.detach().clone() for p in params}  # cast on copy (copy_drawn)


@contextlib.contextmanager
def _real_for_a_moment(params: list[nn.Parameter]) -> Iterator[None]:
    """Within the block each meta parameter holds real CPU storage (same object); meta again after."""
    swapped = []
    try:
        for param in params:
            if param.is_meta:
                # drawn in fp32, as peft constructs them (then casts to the base's dtype)
                dtype = torch.float32 if param.dtype.is_floating_point else param.dtype
                real = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, real)
                swapped.append((param, real))
        yield
    finally:
        for param, real in reversed(swapped):
            torch.utils.swap_tensors(param, real)


def copy_drawn(module: nn.Module, drawn: dict[int, torch.Tensor]) -> None:
    """Write the drawn values into ``module``'s own parameters that have one (a LoRA ``A`` or
    ``B``), and drop them from ``drawn``."""
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if id(param) in drawn and not param.is_meta:
                param.copy_(drawn.pop(id(param)))
