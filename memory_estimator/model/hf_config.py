"""Exact parameter counts and architecture facts from a Hugging Face ``config.json``.

Two paths, one answer: the hand-written families (``hf_families*.py``, read as plain
JSON, no dependency) and, for every other ``model_type``, transformers itself when it
is installed — the model is built on the meta device from the config
(``hf_meta.py``), so nothing is allocated. The tests hold the two against each other.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from ..errors import EstimatorInputError
from .family_table import _FAMILIES, SUPPORTED_MODEL_TYPES, stats_from_layout  # noqa: F401 - re-exported
from .config_defaults import ReadTracker, filled_from_transformers
from .stats import MAX_PLAUSIBLE_PARAMS, ModelStats


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


def _family_stats(config: Mapping[str, Any], family, source: str) -> ModelStats:
    """A hand-written family's stats, the fields the config omits filled as transformers fills them
    (see ``[Note: a config's omitted fields]``)."""
    from .hf_meta import transformers_available

    available = transformers_available()
    tracker = ReadTracker(config)
    layout = family(tracker)
    shown: tuple[str, ...] = ()
    for _ in range(3):  # a filled field can lead the family to read another (Falcon's new architecture)
        completed, filled = filled_from_transformers(config, tracker.missing, available)
        if completed == dict(config):
            break
        shown, config = shown + filled, completed
        tracker = ReadTracker(config)
        layout = family(tracker)
    stats = stats_from_layout(layout, source)
    _refuse_implausible(stats.params, "its layers, widths and vocabulary")
    return replace(stats, config_defaults=shown)


def _refuse_implausible(params: int, what: str) -> None:
    if params > MAX_PLAUSIBLE_PARAMS:
        raise EstimatorInputError(f"this config describes {params:.3g} parameters ({what}), past the "
                                  f"{MAX_PLAUSIBLE_PARAMS:.0e} limit --params has; check the exponents")


def _check_size(config: Mapping[str, Any]) -> None:
    """Refuse a config whose layers alone (hidden² weights each, at the least) are past the limit,
    before a family counts it or transformers builds a million layers."""
    text = config.get("text_config")
    fields = text if isinstance(text, Mapping) else config
    found = {}
    for aliases in (("hidden_size", "n_embd", "d_model", "n_embed"), ("num_hidden_layers", "n_layer", "num_layers")):
        key = next((k for k in aliases if isinstance(fields.get(k), (int, float)) and not isinstance(fields.get(k), bool)),
                   None)
        if key is None or not fields[key] > 0:
            return
        found[key] = fields[key]
    (hidden_key, hidden), (layers_key, layers) = found.items()
    if hidden * hidden * layers > MAX_PLAUSIBLE_PARAMS:
        _refuse_implausible(int(hidden * hidden * layers),
                            f"{hidden_key} = {hidden:.3g} and {layers_key} = {layers:.3g}: hidden² weights per layer")


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
    _check_size(config)
    if model_type in _FAMILIES:
        return _family_stats(config, _FAMILIES[model_type], f"config:{model_type}")
    from .hf_meta import stats_from_transformers, transformers_available

    if transformers_available():
        return stats_from_transformers(config)
    raise EstimatorInputError(
        f"unsupported model_type {model_type!r} without transformers installed; hand-written: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}. Install transformers to build any model type it knows, "
        "or describe the model with --module pkg.mod:build_fn or --params")
