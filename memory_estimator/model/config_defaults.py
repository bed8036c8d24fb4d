"""What a config leaves out: filled with transformers' own defaults, as ``from_config`` would build it.

[Note: a config's omitted fields]
A ``config.json`` may omit a field its config class has a default for; transformers then
builds the model with that default, and derived ones come from the class's ``__init__``
(Mistral's ``num_key_value_heads`` is 8, Llama's is the head count; Qwen3's ``head_dim``
is 128, not hidden/heads). The hand-written families read a config as plain JSON, so a
family records the fields it looked for and did not find (``ReadTracker``); when
transformers is importable, those — and only those: the user's keys always win — are taken
from ``AutoConfig.for_model(model_type, **config).to_dict()`` and the family reads again.
transformers is imported only when something was missing (it costs seconds), and without
it the families' own defaults are transformers' (``tests/estimator/test_estimator_config_defaults.py``
holds them to it). A field the family has no default for (the hidden size, the layers)
stays an error: a truncated file is not a 7B Llama.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

_RESOLUTION_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, AttributeError)


class ReadTracker(Mapping[str, Any]):
    """A config that remembers the fields looked up and absent (each lookup's aliases together)."""

    def __init__(self, config: Mapping[str, Any]):
        self._config = config
        self.missing: list[tuple[str, ...]] = []

    def __getitem__(self, key: str) -> Any:
        return self._config[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._config)

    def __len__(self) -> int:
        return len(self._config)

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._config:
            self.missed((key,))
        return self._config.get(key, default)

    def missed(self, aliases: tuple[str, ...]) -> None:
        if aliases not in self.missing:
            self.missing.append(aliases)


def note_missing(config: Mapping[str, Any], aliases: tuple[str, ...]) -> None:
    """Record that none of ``aliases`` was in ``config`` (a no-op on a plain dict)."""
    if isinstance(config, ReadTracker):
        config.missed(aliases)


def transformers_defaults(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config as transformers' config class completes it, or None when it cannot (an unknown
    model_type, or a value the class refuses: the family's own defaults, equal to transformers', stand)."""
    model_type = config.get("model_type")
    if not model_type:
        return None
    import transformers

    fields = {key: value for key, value in config.items() if key != "model_type"}
    try:
        return transformers.AutoConfig.for_model(model_type, **fields).to_dict()
    except _RESOLUTION_ERRORS:
        return None
    except Exception as error:  # huggingface_hub's strict-dataclass errors derive from Exception only
        if type(error).__module__.startswith(("huggingface_hub", "transformers")):
            return None
        raise


def filled_from_transformers(config: Mapping[str, Any], missing: list[tuple[str, ...]],
                             available: bool) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``config`` plus transformers' value for each missed field (the first alias it knows) when
    transformers is ``available``, and ``name=value`` for each one filled."""
    resolved = transformers_defaults(config) if missing and available else None
    if resolved is None:
        return dict(config), ()
    filled: dict[str, Any] = {}
    for aliases in missing:
        key = next((alias for alias in aliases if alias in resolved), None)
        if key is not None and key not in config:
            filled[key] = resolved[key]
    shown = tuple(f"{key}={value!r}" for key, value in filled.items()
                  if value is not None and not isinstance(value, (dict, list)))
    return {**config, **filled}, shown


def user_wins(resolved: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' completed config under the user's keys, nested configs (``text_config``) key by key."""
    merged = {**resolved}
    for key, value in config.items():
        inner = resolved.get(key)
        merged[key] = user_wins(inner, value) if isinstance(value, Mapping) and isinstance(inner, Mapping) else value
    return merged
