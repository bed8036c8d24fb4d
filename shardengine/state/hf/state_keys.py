"""Which checkpoint tensor feeds which model tensor: names matched exactly, prefixes sensibly.

A checkpoint may come from the model's own class, from a model that holds
ours under a prefix (a ``LlamaForCausalLM`` checkpoint loaded into
``LlamaModel``: ``model.layers.0...``), from the base model of ours (the
reverse: our ``model.`` is absent there), or from a wrapper's state dict
(DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``). A few candidate
renamings are scored by how many model keys they find and the best one wins
(no renaming on ties); names are never matched fuzzily. Pure code.

>>> mapping = best_mapping(["layers.0.w", "norm.w"], {"model.layers.0.w", "model.norm.w", "lm_head.w"},
...                        base_prefix="model")
>>> mapping.checkpoint_key("norm.w"), mapping.covers("lm_head.w"), str(mapping)
('model.norm.w', False, "checkpoint keys under 'model.'")
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

WRAPPER_PREFIXES = ("module", "_orig_mod")


@dataclass(frozen=True)
class KeyMapping:
    """Model key -> checkpoint key: drop ``strip`` from its front, then prepend ``add``."""

    add: str = ""
    strip: str = ""

    def checkpoint_key(self, model_key: str) -> str:
        if self.strip and model_key.startswith(self.strip):
            model_key = model_key[len(self.strip):]
        return self.add + model_key

    def covers(self, checkpoint_key: str) -> bool:
        """Whether a checkpoint key belongs to the part of the checkpoint the model is."""
        return checkpoint_key.startswith(self.add)

    def __str__(self) -> str:
        if self.add:
            return f"checkpoint keys under '{self.add}'"
        if self.strip:
            return f"model keys without '{self.strip}'"
        return "keys as they are"


def best_mapping(model_keys: Iterable[str], checkpoint_keys: set[str],
                 base_prefix: Optional[str] = None) -> KeyMapping:
    """The candidate renaming that finds the most model keys in the checkpoint."""
    model_keys = list(model_keys)
    prefixes = [p for p in dict.fromkeys((base_prefix,) + WRAPPER_PREFIXES) if p]
    candidates = [KeyMapping()] + [KeyMapping(add=f"{p}.") for p in prefixes]
    if base_prefix:
        candidates.append(KeyMapping(strip=f"{base_prefix}."))
    return max(candidates, key=lambda m: sum(m.checkpoint_key(k) in checkpoint_keys for k in model_keys))


@dataclass
class KeyMatch:
    """The outcome of matching: sources per model tensor, and what did not match."""

    mapping: KeyMapping
    source: dict[str, str] = field(default_factory=dict)  # first model key of a tensor -> checkpoint key
    missing: list[str] = field(default_factory=list)      # model keys with no source
    optional_missing: list[str] = field(default_factory=list)  # ... that the model says may be absent
    unexpected: list[str] = field(default_factory=list)   # checkpoint keys nothing reads
    outside: list[str] = field(default_factory=list)      # checkpoint keys outside the mapped prefix


def match_keys(tensor_keys: list[list[str]], checkpoint_keys: set[str], base_prefix: Optional[str] = None,
               ignore_missing: Iterable[str] = (), ignore_unexpected: Iterable[str] = ()) -> KeyMatch:
    """Match each model tensor (all its keys: a tied weight has several) to one checkpoint key.

    A tied tensor is read once, from the first of its keys the checkpoint holds;
    its other keys there count as used. ``ignore_*`` are regular expressions
    (Hugging Face's ``_keys_to_ignore_on_load_missing`` / ``_unexpected``).

    >>> m = match_keys([["embed.w", "head.w"], ["norm.w"]], {"embed.w", "extra.b"})
    >>> m.source, m.missing, m.unexpected
    ({'embed.w': 'embed.w'}, ['norm.w'], ['extra.b'])
    """
    mapping = best_mapping((k for keys in tensor_keys for k in keys), checkpoint_keys, base_prefix)
    match = KeyMatch(mapping)
    used: set[str] = set()
    for keys in tensor_keys:
        found = [mapping.checkpoint_key(k) for k in keys if mapping.checkpoint_key(k) in checkpoint_keys]
        used.update(found)
        if found:
            match.source[keys[0]] = found[0]
        elif _matches_any(keys, ignore_missing):
            match.optional_missing.append(keys[0])
        else:
            match.missing.append(keys[0])
    for key in sorted(checkpoint_keys - used):
        if not mapping.covers(key):
            match.outside.append(key)
        elif not _matches_any([key, key[len(mapping.add):]], ignore_unexpected):
            match.unexpected.append(key)
    return match


def _matches_any(keys: list[str], patterns: Iterable[str]) -> bool:
    return any(re.search(pattern, key) for pattern in patterns for key in keys)
