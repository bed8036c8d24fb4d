"""A module's transformer shape, for the time model only (its activations are traced, not formulas).

The time model prices attention by layers x hidden x sequence and the element-wise kernels by
the hidden and MLP widths (``timing/operations.py``); a traced module would otherwise be
timed as bare matmuls. The shape is read where it is unambiguous: a Hugging Face config of a
family the estimator knows (``hf_families``), else the module's own layers: the repeated
blocks of a ``ModuleList`` (the layers), the input embedding (hidden size, vocabulary), the
attention's head count attribute, the widest linear inside a block (the MLP), RMSNorm by
class name. None when the module has no embedding or no repeated blocks.

>>> from shardengine.testing.models import build_gpt
>>> shape = module_architecture(build_gpt("tiny"))
>>> (shape.layers, shape.hidden, shape.heads, shape.vocab, shape.mlp_width)
(2, 64, 2, 256, 256)
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from .stats import Architecture

_HEAD_ATTRIBUTES = ("num_heads", "n_head", "num_attention_heads", "n_heads")


def module_architecture(module: nn.Module) -> Optional[Architecture]:
    """The transformer shape of ``module`` (see the module docstring), or None."""
    from_config = _from_config(getattr(module, "config", None))
    if from_config is not None:
        return from_config
    blocks = max((list(child) for child in module.modules() if isinstance(child, nn.ModuleList)),
                 key=len, default=[])
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None or len(blocks) < 2:
        return None
    hidden, vocab = embedding.embedding_dim, embedding.num_embeddings
    inner = list(blocks[0].modules())
    heads = next((int(getattr(m, name)) for m in inner for name in _HEAD_ATTRIBUTES
                  if isinstance(getattr(m, name, None), int) and getattr(m, name) > 0), 1)
    widths = [m.out_features for m in inner if isinstance(m, nn.Linear) and m.in_features == hidden]
    return Architecture(
        layers=len(blocks), hidden=hidden, heads=heads if hidden % heads == 0 else 1, vocab=vocab,
        mlp_width=max(widths, default=4 * hidden),
        norm="rmsnorm" if any("rmsnorm" in type(m).__name__.lower() for m in inner) else "layernorm",
        dropout=any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()),
        lm_head=any(isinstance(m, nn.Linear) and m.out_features == vocab for m in module.modules()))


def _from_config(config) -> Optional[Architecture]:
    """A Hugging Face config of a hand-written family (no model is built)."""
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    from .family_table import _FAMILIES, stats_from_layout

    values = to_dict()
    family = _FAMILIES.get(values.get("model_type"))
    if family is None:
        return None
    try:
        return stats_from_layout(family(values), f"config:{values['model_type']}").architecture
    except Exception:  # noqa: BLE001 - a config the family reads differently: read the layers instead
        return None
