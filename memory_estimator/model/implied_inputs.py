"""The example inputs a module implies, so ``stage="auto"`` never decides without activations.

[Note: auto counts activations or refuses]
Activations are most of a step's peak at the context lengths people train at; a plan chosen
on model states alone is a plan chosen blind. ``stage="auto"`` is given ``micro_batch`` and
``seq_len``; what it still needs is what the module takes. In order:

1. ``example_inputs=`` as given to ``shard()``;
2. the module's own ``example_inputs(micro_batch, seq_len)`` method or attribute;
3. a Hugging Face model (a ``config`` with ``vocab_size`` and ``to_dict``): ``input_ids`` of
   micro_batch x seq_len token ids below the config's vocabulary, and ``labels`` the same
   when the model has a language-model head (it then computes its own loss, as it trains);
4. a module whose first layer (the first module holding parameters, in registration
   order) is an ``nn.Embedding``: token ids of micro_batch x seq_len below its size.

Anything else is refused with an error saying to pass ``example_inputs=``: a guess at a
shape would be a silent wrong number. The answer carries a sentence saying what was traced.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..errors import EstimatorInputError
from .module import ExampleInputs

REFUSAL = ("stage='auto' counts activations by tracing one step of the model on fake tensors, and cannot tell "
           "what this module takes as input; pass example_inputs=lambda micro_batch, seq_len: ... returning its "
           "inputs (a tensor, a tuple of positional arguments or a dict of keyword arguments)")


def implied_inputs(module: nn.Module, given: Optional[ExampleInputs] = None) -> tuple[ExampleInputs, str]:
    """(example inputs, what they are in words) for ``module``; an ``EstimatorInputError`` saying
    to pass ``example_inputs=`` when the module does not say (see the note above)."""
    if given is not None:
        return given, "the example_inputs given"
    own = getattr(module, "example_inputs", None)
    if callable(own):
        return own, "the model's own example_inputs(micro_batch, seq_len)"
    config = getattr(module, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0 and callable(getattr(config, "to_dict", None)):
        return _hugging_face(module, vocab)
    first = next((m for m in module.modules() if any(True for _ in m.parameters(recurse=False))), None)
    if isinstance(first, nn.Embedding):
        size = first.num_embeddings
        return _token_ids(size), f"token ids of micro_batch x seq_len below {size:,} (the first layer is an nn.Embedding)"
    raise EstimatorInputError(REFUSAL)


def _token_ids(vocab: int) -> Callable[[int, int], torch.Tensor]:
    def make(micro_batch: int, seq_len: int) -> torch.Tensor:
        return torch.randint(vocab, (micro_batch, seq_len))
    return make


def _hugging_face(module: nn.Module, vocab: int) -> tuple[ExampleInputs, str]:
    get_head = getattr(module, "get_output_embeddings", None)
    language_model = callable(get_head) and get_head() is not None
    ids = _token_ids(vocab)

    def make(micro_batch: int, seq_len: int) -> dict:
        tokens = ids(micro_batch, seq_len)
        return {"input_ids": tokens, "labels": tokens} if language_model else {"input_ids": tokens}

    what = "input_ids and labels" if language_model else "input_ids"
    return make, f"{what} of micro_batch x seq_len token ids below the config's vocabulary ({vocab:,})"
