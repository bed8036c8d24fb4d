"""Any transformers ``model_type``: build the model on the meta device from its config.

Optional: transformers is imported only here, and only when a config's model_type has
no hand-written family. Building under ``torch.device("meta")`` allocates nothing (a
70B model builds in seconds). Counts are exact: parameters are deduplicated by
identity, so tied embeddings count once, and every MoE expert is a real module.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any, Mapping

from torch import nn

from ..errors import EstimatorInputError
from .config_defaults import user_wins
from .hf_families import checkpoint_bytes, has_dropout, softcaps
from .module import module_stats, unique_parameters
from .stats import Architecture, ModelStats

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _check_known_model_type(model_type: str, transformers) -> None:
    """An unknown type in one line with the closest known ones, not transformers' list of hundreds."""
    import difflib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type in known:
        return
    close = difflib.get_close_matches(str(model_type), known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise EstimatorInputError(
        f"transformers {transformers.__version__} does not know model_type {model_type!r}{hint} "
        f"({len(known)} types known; a newer transformers may know it); "
        "describe the model with --module pkg.mod:build_fn or --params")


def build_meta_model(config: Mapping[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """The model ``config`` describes, on the meta device (its ``architectures`` class if named),
    and the config as transformers completed it (the user's keys win; ``config_defaults.py``)."""
    import torch
    import transformers

    model_type = config.get("model_type")
    if not model_type:
        raise EstimatorInputError("config has no model_type; use --module pkg.mod:build_fn or --params")
    fields = {key: value for key, value in config.items() if key != "model_type"}
    _check_known_model_type(model_type, transformers)
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise EstimatorInputError(
            f"transformers {transformers.__version__} cannot read this {model_type} config ({first_line[:200]}); "
            "fix the config, or describe the model with --module pkg.mod:build_fn or --params") from None
    with torch.device("meta"):
        for build in _builders(config, transformers):
            try:
                return build(hf_config), user_wins(hf_config.to_dict(), config)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    raise EstimatorInputError(f"transformers could not build model_type {model_type!r} from this config; "
                              "describe the model with --module pkg.mod:build_fn or --params")


def _builders(config: Mapping[str, Any], transformers):
    for name in config.get("architectures") or []:
        cls = getattr(transformers, str(name), None)
        if cls is not None:
            yield cls._from_config
    yield transformers.AutoModelForCausalLM.from_config
    yield transformers.AutoModelForSeq2SeqLM.from_config
    yield transformers.AutoModel.from_config


def _blocks(model: nn.Module) -> nn.ModuleList | None:
    """The repeated blocks: the ModuleList holding the most parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def _gated(block: nn.Module, width: int | None) -> bool:
    """A gated MLP has a gate projection, or a fused gate+up of twice the width."""
    names = [name for name, _ in block.named_modules()]
    if any(name.endswith(("gate_proj", "w1", "gate_up_proj", "w13", "wi_0")) for name in names):
        return True
    return bool(width) and any(isinstance(m, nn.Linear) and m.out_features == 2 * width for m in block.modules())


def _attends(block: nn.Module) -> bool:
    return any("Attention" in type(m).__name__ or "Attn" in type(m).__name__ for m in block.modules())


def _language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The fields of the language model: a multimodal config's ``text_config`` (Llava, Gemma-3)."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        return {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
    return config


def _unmodelled(config: Mapping[str, Any], model_type: str, blocks: nn.ModuleList | None) -> tuple[str, ...]:
    """What the transformer activation model does not cover: the towers beside the language model,
    or blocks that are not attention blocks (Mamba's state-space mixers, Jamba's hybrid stack)."""
    towers = tuple(f"the {key.removesuffix('_config')} tower's activations ({model_type}'s {key}: they grow with "
                   "its inputs, which --seq-len does not describe)"
                   for key in ("vision_config", "audio_config", "speech_config") if isinstance(config.get(key), Mapping))
    if blocks is not None and all(_attends(block) for block in blocks):
        return towers
    which = "its blocks" if blocks is None else f"{sum(not _attends(b) for b in blocks)} of its {len(blocks)} blocks"
    return towers + (f"{model_type}'s activations ({which} are not attention blocks, the only kind the "
                     "activation model covers)",)


def _architecture(config: Mapping[str, Any], model: nn.Module, blocks: nn.ModuleList | None) -> Architecture | None:
    config = _language_config(config)

    def first(*keys: str) -> Any:
        return next((config[key] for key in keys if isinstance(config.get(key), int)), None)

    hidden = first("hidden_size", "n_embd", "d_model", "dim")
    heads = first("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
    layers = first("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers")
    vocab = first("vocab_size")
    if not all((hidden, heads, layers, vocab)):
        return None
    width = first("moe_intermediate_size", "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff",
                  "encoder_ffn_dim")
    experts = first(*_EXPERT_KEYS) or 0
    block = blocks[0] if blocks is not None else model
    rms = any("RMSNorm" in type(m).__name__ or type(m).__name__ == "T5LayerNorm" for m in block.modules())
    arch = Architecture(layers, hidden, heads, vocab, kv_heads=first("num_key_value_heads", "num_kv_heads"),
                        head_dim=first("head_dim", "d_kv"), mlp_width=width, gated_mlp=_gated(block, width),
                        norm="rmsnorm" if rms else "layernorm", dropout=has_dropout(config),
                        checkpoint_bytes=checkpoint_bytes(config), norms_per_layer=_hidden_norms(block, hidden),
                        qk_norm=any(name.endswith(_QK_NORMS) for name, _ in block.named_modules()),
                        **softcaps(_softcap_settings(model)))
    if experts:
        shared = first("shared_expert_intermediate_size") or 0
        arch = replace(arch, experts=experts, experts_per_token=first("num_experts_per_tok", "top_k") or 1,
                       shared_expert_width=shared)
    decoder_layers = first("num_decoder_layers", "decoder_layers")
    if config.get("is_encoder_decoder") and decoder_layers:
        # T5, BART: the encoder's self-attention blocks, then a decoder whose blocks also attend
        # to the encoder's output (the source and the target both --seq-len long)
        # (T5 and BART norm each sub-layer: two in an encoder block, three in a decoder block)
        arch = replace(arch, layers=decoder_layers, cross_attention=True, norms_per_layer=3,
                       encoder=replace(arch, lm_head=False, norms_per_layer=2))
    return arch


_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")


def _hidden_norms(block: nn.Module, hidden: int) -> int:
    """Norms over the hidden state in one block (Gemma-2/3 have four), 2 when none is found."""
    def width(module: nn.Module) -> int | None:
        shape = getattr(module, "normalized_shape", None) or getattr(getattr(module, "weight", None), "shape", None)
        return shape[-1] if shape else None
    count = sum(1 for m in block.modules() if "Norm" in type(m).__name__ and width(m) == hidden)
    return count or 2


def _softcap_settings(model: nn.Module) -> dict[str, Any]:
    """The soft-caps transformers' config holds, its family's defaults filled in (text config for multimodal)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    keys = ("attn_logit_softcapping", "final_logit_softcapping")
    return {key: getattr(config, key, None) for key in keys}


def stats_from_transformers(config: Mapping[str, Any]) -> ModelStats:
    """ModelStats of the model transformers builds from ``config`` (on the meta device)."""
    model, resolved = build_meta_model(config)
    stats = module_stats(model)
    blocks = _blocks(model)
    block_sizes = [sum(p.numel() for p in unique_parameters(block)) for block in blocks] if blocks is not None else []
    unmodelled = _unmodelled(resolved, str(config.get("model_type")), blocks)
    architecture = _architecture(resolved, model, blocks)
    if architecture is None and not unmodelled:
        unmodelled = (f"{config.get('model_type')}'s activations (its config does not state the hidden size, "
                      "heads, layers and vocabulary the activation model needs)",)
    if any(part.startswith(f"{config.get('model_type')}'s") for part in unmodelled):
        architecture = None  # not a transformer the formula describes: no partial count to lean on
    return replace(
        stats, source=f"config:{config.get('model_type')} (transformers)",
        architecture=architecture, unmodelled_activations=unmodelled,
        outside_params=stats.params - sum(block_sizes) if block_sizes else None,
        block_params=max(block_sizes, default=None),
        largest_tensor=max((p.numel() for p in unique_parameters(model)), default=0))
