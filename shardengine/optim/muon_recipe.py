"""The Muon recipe in one call: Muon on the hidden matrices, AdamW on everything else.

Muon is meant for the 2-D weights of hidden layers; embeddings, the output
head, norms and biases train better with AdamW (Keller Jordan's Muon,
modded-nanogpt, Moonlight). :func:`muon_with_adamw` splits a model's
trainable parameters that way and returns one :class:`OptimizerList`, ready
for ``se.shard`` at any stage.

A parameter is a *hidden matrix* when it is 2-D, no ``nn.Embedding`` holds it
(a head tied to the embedding counts as the embedding), and it is not in a
head module. Head modules are the ones named in ``head`` (module names, as
``model.named_modules()`` gives them), by default any module whose last name
component is one of :data:`HEAD_NAMES`.

>>> from shardengine.testing.models import build_gpt
>>> opts = muon_with_adamw(build_gpt("tiny"), lr=0.02, adamw_lr=3e-3)
>>> [type(o).__name__ for o in opts], [len(o.param_groups[0]["params"]) for o in opts]
(['Muon', 'AdamW'], [8, 20])
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ..errors import ConfigError
from .optimizer_list import OptimizerList

HEAD_NAMES = ("head", "lm_head", "output", "classifier", "score", "embed_out")


def split_hidden_matrices(model: nn.Module, head: Optional[Iterable[str]] = None
                          ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(hidden matrices, everything else)``: the model's trainable parameters, each once."""
    heads = set(head) if head is not None else None
    modules = dict(model.named_modules())
    if heads is not None and heads - set(modules):
        raise ConfigError(f"head names {sorted(heads - set(modules))} are not modules of the model")
    not_hidden: set[int] = set()
    for name, module in modules.items():
        is_head = name in heads if heads is not None else name.rsplit(".", 1)[-1] in HEAD_NAMES
        if isinstance(module, nn.Embedding) or is_head:
            not_hidden.update(id(p) for p in module.parameters())
    hidden, rest = [], []
    for param in model.parameters():  # each shared parameter once
        if param.requires_grad:
            (hidden if param.ndim == 2 and id(param) not in not_hidden else rest).append(param)
    return hidden, rest


def muon_with_adamw(model: nn.Module, lr: float = 0.02, momentum: float = 0.95,
                    weight_decay: float = 0.0, adamw_lr: float = 3e-4,
                    adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_weight_decay: float = 0.0,
                    head: Optional[Iterable[str]] = None, **muon_options) -> OptimizerList:
    """``OptimizerList([Muon(hidden matrices), AdamW(the rest)])`` for ``se.shard(model, ...)``.

    ``muon_options`` go to ``torch.optim.Muon`` (``nesterov``, ``ns_steps``,
    ``adjust_lr_fn``, ...). A model without hidden matrices (or with nothing else)
    is an error: use one optimizer then.
    """
    hidden, rest = split_hidden_matrices(model, head)
    if not hidden or not rest:
        raise ConfigError(f"muon_with_adamw: the model has {len(hidden)} hidden matrices and {len(rest)} "
                          "other trainable parameters; both must be non-empty (else use one optimizer)")
    muon = torch.optim.Muon(hidden, lr=lr, momentum=momentum, weight_decay=weight_decay, **muon_options)
    adamw = torch.optim.AdamW(rest, lr=adamw_lr, betas=adamw_betas, weight_decay=adamw_weight_decay)
    names = {id(p): name for name, p in model.named_parameters()}
    return OptimizerList([muon, adamw], names)
