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
from .family_table import _FAMILIES, SUPPORTED_MODEL_TYPES, stats_from_layout  # noqa: F401 - re-exported
from .stats import ModelStats


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
