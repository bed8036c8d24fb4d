"""One training step's shape-dependent tensors, in the order the step allocates and frees them.

[Note: a step as the allocator sees it]
Only tensors whose size follows the batch's length matter to what varying lengths leave
in the cache; the model states are allocated once and never move. A step at ``t`` tokens:

- forward, layer by layer: the tensors the layer produces (``activations.py``'s terms,
  one tensor each: norm upcasts and outputs, q, k, v, the s×s scores when attention is not
  fused, the MLP's gate/up/activation/product, the rest of the layer as one tensor); a
  checkpointed layer frees all but its input at once (they were temporaries);
- the final norm and the head's input, then the loss chain (``kernels.loss_bytes``'s
  tensors: the logits, their fp32 copy and log-probabilities, or their 16-bit forms, or
  the chunks of a chunked loss, or an in-place loss's logits and their cast copy; the
  soft-capped logits' tanh output before a plain or chunked loss);
- backward: the loss chain's gradients while its forward tensors are freed, then each
  layer in reverse: a checkpointed layer's tensors recomputed, one gradient per tensor
  the layer saved (each freed as the next is made), the layer's saved tensors freed.

The byte sizes add up to the activation model's own (``ActivationProfile``): the trace
decides only the order and the split into tensors, which is what the allocator's
segments follow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from ..model.stats import Architecture
from ..terms.activations import (ActivationInputs, _kv_saved_heads, _layer_policy_bytes, _norm_element_bytes,
                                 _outside_bytes)
from ..terms.checkpointing import parse_policy
from ..terms.kernels import CHUNKS, check_loss, softcap_bytes

Event = tuple[str, int, int]     # ("alloc", key, bytes) or ("free", key, 0)


@dataclass(frozen=True)
class StepShape:
    """What a step's trace needs besides the length: the model, how activations are kept, the loss."""

    architecture: Architecture
    inputs: ActivationInputs            # micro-batch, checkpointing, kernels; its seq_len is the cap
    loss: str = "plain"
    loss_upcast: bool = True
    logits_cast: int | None = None      # bytes per logit after a cast before an in-place loss (Unsloth's)

    def at(self, seq_len: int) -> "StepShape":
        from dataclasses import replace
        return replace(self, inputs=replace(self.inputs, seq_len=seq_len))


def layer_tensors(arch: Architecture, inputs: ActivationInputs, moe: bool = False) -> tuple[list[int], list[int]]:
    """(produced, kept): per-token bytes of the tensors one layer makes in forward and of those it
    keeps for backward; ``sum(produced)`` and ``sum(kept)`` are the activation model's."""
    policy = parse_policy(inputs.checkpointing)
    kept_bytes, full_bytes = _layer_policy_bytes(arch, inputs, policy, moe)
    c, h = inputs.compute_bytes, arch.hidden
    pieces: list[int] = []
    if not moe:
        element = _norm_element_bytes(arch, c, inputs.autocast, inputs.kernels)
        upcast = 4 if element > (4 if inputs.autocast else c) else 0
        pieces += [upcast * h, (element - upcast) * h] * arch.norms_per_layer
        if arch.qk_norm:    # the query and key norms' upcasts and outputs
            for width in (arch.heads * arch.dim, arch.kv * arch.dim):
                pieces += [upcast * width, (element - upcast) * width]
        kv = _kv_saved_heads(arch, not inputs.fused_attention) * arch.dim
        pieces += [c * arch.heads * arch.dim, c * kv, c * kv]
        if not inputs.fused_attention:
            pieces.append((4 if inputs.autocast else c) * arch.heads * inputs.seq_len)
            if arch.attention_softcap:
                pieces.append(c * arch.heads * inputs.seq_len)      # tanh's output
        pieces += [c * arch.width] * (3 if arch.gated_mlp else 2)
    pieces = [p for p in pieces if p > 0]
    if sum(pieces) > full_bytes:
        pieces = []
    produced = pieces + ([full_bytes - sum(pieces)] if full_bytes > sum(pieces) else [])
    if kept_bytes == full_bytes:
        return produced, list(produced)
    layer_input = (4 if inputs.autocast else c) * h
    kept = [layer_input] if kept_bytes == layer_input else [kept_bytes]
    return produced, kept


def loss_tensors(shape: StepShape) -> tuple[list[int], int, list[int]]:
    """(forward, dropped, backward): per-token bytes of the loss chain's tensors, how many of the
    first forward ones are freed before backward starts, and the backward's gradients."""
    arch, c = shape.architecture, shape.inputs.compute_bytes
    v, h = arch.vocab, arch.hidden
    if not arch.lm_head:
        return [], 0, []
    loss = check_loss(shape.loss)
    capped = [size for size in [softcap_bytes(loss, c) * v] if size and arch.logit_softcap]  # tanh's output
    if loss == "plain":
        if shape.loss_upcast or c == 4:
            return capped + [c * v, 4 * v, 4 * v], 0, [4 * v, 4 * v]
        if capped:      # the capped logits and their shifted copy go first, tanh's output stays
            return [c * v, c * v] + capped + [c * v], 2, [c * v, c * v]
        return [c * v, c * v, c * v], 2, [c * v, c * v]     # the logits and their shifted copy go first
    if loss == "chunked":
        kept = c if shape.inputs.kernels.compiled else 4
        chunk = math.ceil(v / CHUNKS)
        return [c * chunk] + capped + [kept * chunk] * CHUNKS, 1, [4 * chunk]
    if loss == "inplace":
        cast = shape.logits_cast
        if cast in (None, c):     # the logits, their gradient written over them, then d(hidden)
            return [c * v], 0, [c * h]
        return [c * v, cast * v], 1, [c * v, c * h]   # the head's output goes at the cast; the cast's gradient
    return [(4 + c) * h, c * h], 1, [c * h]


def step_events(shape: StepShape) -> Iterator[Event]:
    """The allocate/free events of one step at ``shape.inputs.seq_len`` tokens per sequence."""
    arch, inputs = shape.architecture, shape.inputs
    tokens = inputs.micro_batch * inputs.seq_len
    keys = iter(range(1 << 62))
    policy = parse_policy(inputs.checkpointing)
    layers = []
    first_moe = arch.layers - arch.moe_layer_count   # dense layers first, then the MoE ones
    # every dense layer makes the same tensors, and every MoE layer: each kind sized once per step
    kinds = {moe: layer_tensors(arch, inputs, moe) for moe in {0 >= first_moe, arch.layers - 1 >= first_moe}}
    for index in range(arch.layers):
        produced, kept = kinds[index >= first_moe]
        checkpointed = policy.kind != "none" and index % policy.every == 0
        if not checkpointed:
            kept = list(produced)
        made = [(next(keys), size * tokens) for size in produced]
        yield from (("alloc", key, size) for key, size in made)
        saved = made if kept == produced else [(next(keys), size * tokens) for size in kept]
        if saved is not made:
            yield from (("alloc", key, size) for key, size in saved)
            yield from (("free", key, 0) for key, _ in made)
        layers.append((produced, saved))
    outside = [(next(keys), tokens * _outside_bytes(arch, inputs))]
    yield from (("alloc", key, size) for key, size in outside)
    forward, dropped, backward = loss_tensors(shape)
    chain = [(next(keys), size * tokens) for size in forward]
    yield from (("alloc", key, size) for key, size in chain)
    yield from (("free", key, 0) for key, _ in chain[:dropped])
    gradient = None
    for (key, _), size in zip(reversed(chain[dropped:]), backward + [0] * len(chain)):
        if size:
            new = next(keys)
            yield ("alloc", new, size * tokens)
            if gradient is not None:
                yield ("free", gradient, 0)
            gradient = new
        yield ("free", key, 0)
    for size in backward[len(chain) - dropped:]:
        new = next(keys)
        yield ("alloc", new, size * tokens)
        if gradient is not None:
            yield ("free", gradient, 0)
        gradient = new
    yield from _backward_layers(layers, tokens, keys, gradient, outside)


def _backward_layers(layers, tokens: int, keys, gradient, outside) -> Iterator[Event]:
    for key, _ in outside:
        yield ("free", key, 0)
    for produced, saved in reversed(layers):
        recomputed = []
        if len(saved) < len(produced):
            recomputed = [(next(keys), size * tokens) for size in produced]
            yield from (("alloc", key, size) for key, size in recomputed)
        for key, size in reversed(recomputed or saved):
            new = next(keys)
            yield ("alloc", new, size)
            if gradient is not None:
                yield ("free", gradient, 0)
            gradient = new
            yield ("free", key, 0)
        if recomputed:
            yield from (("free", key, 0) for key, _ in saved)
    if gradient is not None:
        yield ("free", gradient, 0)
