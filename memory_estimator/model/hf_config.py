"""Exact parameter counts and architecture facts from a Hugging Face ``config.json``.

Two paths, one answer: the hand-written families (``hf_families*.py``, read as plain
JSON, no dependency) and, for every other ``model_type``, transformers itself when it
is installed — the model is built on the meta device from the config
(``hf_meta.py``), so nothing is allocated. The tests hold the two against each other.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from ..errors import EstimatorInputError
from .hf_families import FamilyFn, Layout, gemma, gemma2, llama, mixtral, olmo, olmo2, phi3, qwen2, qwen3
from .hf_families_classic import bert, bloom, falcon, gpt2, gpt_neox, opt, phi, starcoder2
from .hf_families_moe import deepseek, qwen2_moe, qwen3_moe
from .stats import ModelStats

_FAMILIES: dict[str, FamilyFn] = {
    "llama": llama, "mistral": llama, "mixtral": mixtral, "qwen2": qwen2, "qwen3": qwen3,
    "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "gemma": gemma, "gemma2": gemma2, "phi": phi,
    "phi3": phi3, "gpt2": gpt2, "gpt_neox": gpt_neox, "falcon": falcon, "opt": opt, "bloom": bloom,
    "starcoder2": starcoder2, "olmo": olmo, "olmo2": olmo2, "deepseek_v2": deepseek, "deepseek_v3": deepseek,
    "bert": bert,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


def read_config(path: str | Path) -> dict[str, Any]:
    """Load a config.json as a dict, with one-line errors for missing or malformed files."""
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    try:
        text = config_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EstimatorInputError(f"config file not found: {config_path}") from None
    except OSError as error:
        raise EstimatorInputError(f"cannot read config file {config_path}: {error.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise EstimatorInputError(
            f"malformed JSON in {config_path}: {error.msg} at line {error.lineno}") from None
    if not isinstance(config, dict):
        raise EstimatorInputError(f"{config_path} must hold a JSON object, not {type(config).__name__}")
    return config


def stats_from_layout(layout: Layout, source: str) -> ModelStats:
    """ModelStats from a family's shapes: totals, the largest unit and tensor, the root."""
    blocks = [(tally, count) for tally, count in layout.blocks if count]
    params = sum(tally.numel * count for tally, count in blocks) + layout.outside.numel
    largest_block = max((tally.numel for tally, _ in blocks), default=0)
    return ModelStats(
        params=params,
        largest_unit=max(largest_block, layout.largest_outside_unit),
        architecture=layout.architecture,
        factored_state_numel=sum(t.factored_numel * n for t, n in blocks) + layout.outside.factored_numel,
        source=source,
        outside_params=layout.outside.numel,
        block_params=largest_block,
        largest_tensor=max([t.largest_tensor for t, _ in blocks] + [layout.outside.largest_tensor]),
    )


def stats_from_config(config: Mapping[str, Any] | str | Path) -> ModelStats:
    """Exact unique parameter count and architecture facts from a HF-style config.

    >>> cfg = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
    ...        "n_embd": 768, "n_layer": 12, "n_head": 12}
    >>> stats_from_config(cfg).params
    124439808
    """
    if not isinstance(config, Mapping):
        config = read_config(config)
    model_type = config.get("model_type")
    if model_type in _FAMILIES:
        return stats_from_layout(_FAMILIES[model_type](config), f"config:{model_type}")
    from .hf_meta import stats_from_transformers, transformers_available

    if transformers_available():
        return stats_from_transformers(config)
    raise EstimatorInputError(
        f"unsupported model_type {model_type!r} without transformers installed; hand-written: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}. Install transformers to build any model type it knows, "
        "or describe the model with --module pkg.mod:build_fn or --params")
