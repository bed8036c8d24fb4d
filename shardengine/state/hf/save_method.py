"""``model.save_pretrained(folder)`` on the wrapped model: what a Hugging Face user calls.

A Hugging Face model writes the weights folder (the same as
:func:`shardengine.save_pretrained`); a PEFT model writes what peft's own
``save_pretrained`` writes, the adapter only. Collective: every rank calls it.

[Note: an adapter is saved without its base]
peft's ``save_pretrained`` reads ``model.state_dict()`` and keeps the adapter
keys. At stage 3 that state dict would need every frozen base weight
gathered. Instead the engine gathers only the buckets holding adapter
parameters (a unit's frozen and trainable parameters live in separate
buckets), and hands peft that small state dict through its ``state_dict=``
argument; rank 0 writes, with peft's own code, so the folder is exactly
peft's (``adapter_config.json``, ``adapter_model.safetensors``) and
``PeftModel.from_pretrained`` loads it.

Hugging Face arguments the engine cannot honour (``push_to_hub=True``, a
caller-built ``state_dict``, pickle serialization, ...) are refused by name
instead of being ignored.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...errors import ConfigError
from ..full_state import selected_state_dict

# Arguments accepted at their default value only, and what to do instead.
_DEFAULT_ONLY = {
    "push_to_hub": (False, "save the folder, then upload it from one rank "
                           "(huggingface_hub.upload_folder)"),
    "state_dict": (None, "the engine gathers the values itself; to save other values, load them "
                         "into the model first (model.load_state_dict)"),
    "safe_serialization": (True, "only safetensors files are written"),
    "variant": (None, "rename the written files yourself"),
    "token": (None, "it is only used to push to the Hub"),
    "save_function": (None, "the engine writes the files itself"),
    "distributed_checkpoint": (False, "se.save_checkpoint writes a sharded training checkpoint"),
    "save_embedding_layers": ("auto", "the base embeddings are not gathered for an adapter save"),
    "path_initial_model_for_weight_conversion": (None, "convert the saved adapter with peft afterwards"),
    "convert_pissa_to_lora": (None, "convert the saved adapter with peft afterwards"),
}
# Accepted as given: the engine decides which rank writes, and an adapter fits one file.
_IGNORED = {"is_main_process", "save_peft_format", "save_original_format"}


def save_pretrained_method(model: nn.Module, module: nn.Module, folder: str, kwargs: dict[str, Any]) -> None:
    """``ShardedModel.save_pretrained``: the HF folder, or the adapter of a PEFT model."""
    if not hasattr(module, "save_pretrained"):
        raise AttributeError(f"'{type(module).__name__}' object has no attribute 'save_pretrained'; "
                             "se.save_pretrained(model, folder) writes any sharded model")
    options = _check_arguments(kwargs)
    if getattr(module, "_hf_peft_config_loaded", False):
        raise ConfigError("model.save_pretrained on a Hugging Face model with adapters loaded through "
                          "transformers (load_adapter / add_adapter) is not supported; wrap the model "
                          "with peft.get_peft_model before shard() instead")
    if is_peft_model(module):
        save_adapter(model, module, folder, options)
        return
    from .pretrained import save_pretrained

    unknown = set(options) - {"max_shard_size", "dtype"}
    if unknown:
        raise ConfigError(f"save_pretrained: argument(s) {sorted(unknown)} are not supported here")
    save_pretrained(model, folder, **options)


def is_peft_model(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft" and isinstance(getattr(module, "peft_config", None), dict)


def save_adapter(model: nn.Module, module: nn.Module, folder: str, options: dict[str, Any]) -> None:
    """Gather the adapter parameters only and let peft write them (see the Note)."""
    from ..checkpoint import _agree, _engine_of

    engine = _engine_of(model)
    unknown = set(options) - {"selected_adapters", "max_shard_size"}
    if unknown:
        raise ConfigError(f"save_pretrained of a PEFT model: argument(s) {sorted(unknown)} are not supported")
    adapters = options.get("selected_adapters") or list(module.peft_config)
    missing = [name for name in adapters if name not in module.peft_config]
    if missing:
        raise ConfigError(f"save_pretrained: no adapter named {missing}; the model has {list(module.peft_config)}")
    markers = tuple(f".{name}." for name in adapters)
    state = selected_state_dict(engine, lambda key, p: p.requires_grad or any(m in key for m in markers))
    _agree(engine.comm, f"save the adapter to {folder}",
           lambda: module.save_pretrained(folder, selected_adapters=adapters, state_dict=state,
                                          is_main_process=engine.comm.rank == 0))


def _check_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse what cannot be honoured; return the rest (minus what is ignored)."""
    options = {}
    for name, value in kwargs.items():
        if name in _DEFAULT_ONLY:
            default, instead = _DEFAULT_ONLY[name]
            if value is not default and value != default:
                raise ConfigError(f"save_pretrained({name}={value!r}) is not supported on a sharded "
                                  f"model: {instead}")
        elif name not in _IGNORED:
            options[name] = value
    return options
