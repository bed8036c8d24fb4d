"""Analytic activation memory of a transformer, tensor by tensor (after Korthikanti et al. 2022).

Per layer and per token, with c bytes per compute-dtype element (2 for bf16/fp16, 4
for fp32) and 1 byte per dropout mask, backward needs:

==================  =========================================  ==================
tensor              bytes per token                            Korthikanti (c=2)
==================  =========================================  ==================
two norm inputs     LayerNorm: c·h each; RMSNorm as HF/Meta    4h
                    write it (fp32 upcast): (4 + c)·h each
q/k/v input         c·h                                        2h
q/k norms           Qwen3, Gemma-3, OLMo-2: as a norm, over     -
                    the a·d + kv·d query and key elements
q, k, v             c·(a·d + 2·kv·d)  (kv < a under GQA);       6h
                    unfused: c·3·a·d (``repeat_kv``'s copies)
scores (unfused)    softmax output c·a·s, + mask a·s and        5·a·s
                    dropout output c·a·s with attention dropout;
                    + tanh output c·a·s with Gemma-2's soft-cap
out-proj input      c·a·d                                      2h
dropout mask        h (when the model has dropout)             1h
MLP input           c·h                                        2h
MLP core            plain: c·f (activation input) + c·f        16h (f = 4h)
                    (its output); gated: 4·c·f (gate, act, up,
                    product)
MLP dropout mask    h                                          1h
==================  =========================================  ==================

which is exactly ``34·sbh + 5·a·s²·b`` for Korthikanti's GPT and learns what a
family really has: the gated MLP's width, GQA's narrower k/v, RMSNorm's fp32 upcast.
An MoE layer routes each token to ``k`` experts: a router (fp32 logits, 4·E), and per
chosen expert a dispatched copy of the input, the expert's MLP core and its output.

Under autocast (``--amp``) the norms and the softmax run in fp32 (their inputs and
outputs are saved in fp32; the residual stream stays fp32) while the matmuls save
c-byte copies; see ``autocast`` in ``layer_bytes``.

Checkpointing policies are rules on which of these tensors are kept (``checkpointing.py``);
the logits and the loss are a separate term (``logits_loss_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .checkpointing import CHECKPOINTING_MODES, CheckpointPolicy, check_checkpointing, parse_policy
from .kernels import Kernels
from ..model.stats import Architecture

__all__ = ["ActivationInputs", "ActivationProfile", "activation_bytes", "activation_profile",
           "check_checkpointing", "CHECKPOINTING_MODES", "layer_activation_bytes", "logits_loss_bytes",
           "layer_bytes", "matmul_output_bytes"]


@dataclass(frozen=True)
class ActivationInputs:
    """One micro-batch's shape and how its activations are kept."""

    micro_batch: int
    seq_len: int
    checkpointing: str = "none"
    fused_attention: bool = True
    fp32_activations: bool = False
    autocast: bool = False             # torch AMP: fp32 norms/softmax/residual, c = 2 for matmuls
    kernels: Kernels = field(default_factory=lambda: Kernels())
    offload: bool = False              # saved activations moved to host RAM as forward saves them

    @property
    def compute_bytes(self) -> int:
        return 4 if self.fp32_activations else 2

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes at the two moments that can be the peak.

    ``stored``: what forward leaves saved for backward (all layers). ``recompute``:
    what backward adds while it recomputes the first checkpointed layer (one layer's
    activations beyond what that layer kept), when the logits are already freed.
    """

    stored: int
    recompute: int = 0
    host: int = 0      # saved activations offloaded to host RAM (pinned), per rank
    # traced modules: the most bytes kept for backward on the device and on the host, as
    # memory_report().peak_activations / peak_host_activations measure them (traced_blocks.py)
    kept: int = 0
    kept_host: int = 0

    @property
    def peak(self) -> int:
        return self.stored + self.recompute


def _norm_element_bytes(arch: Architecture, c: int, autocast: bool, kernels: Kernels = Kernels()) -> int:
    """Bytes one norm saves per normalized element: its (fp32, for RMSNorm) input and normalized output.

    A fused RMSNorm kernel (or a compiled one) saves only its input and a per-row rstd."""
    out = 4 if autocast else c
    if arch.norm == "rmsnorm" and not kernels.fused_norm:
        return 4 + out
    return out  # native LayerNorm saves its input only


def _norm_bytes(arch: Architecture, c: int, autocast: bool, kernels: Kernels = Kernels()) -> int:
    """Bytes one norm over the hidden state saves per token."""
    return _norm_element_bytes(arch, c, autocast, kernels) * arch.hidden


def _qk_norm_bytes(arch: Architecture, c: int, autocast: bool, kernels: Kernels = Kernels()) -> int:
    """Per-token bytes the norms over the queries and keys save (Qwen3, Gemma-3, OLMo-2).

    [Note: query/key norms]
    ``q_norm(q_proj(x))`` saves what a norm over the hidden state saves, over the a·d query
    and kv·d key elements: the fp32 upcast of the projection's output and the normalized
    output (HF's eager RMSNorm), which rotary then turns into the q and k attention keeps.
    The projection's own c-byte output is not kept (the upcast replaces it; in fp32 the
    upcast is that very tensor). Per-head (Qwen3, Gemma-3) and whole-projection (OLMo-2)
    norms normalize the same elements."""
    if not arch.qk_norm:
        return 0
    return _norm_element_bytes(arch, c, autocast, kernels) * (arch.heads + arch.kv) * arch.dim


def _mlp_core(width: int, gated: bool, c: int, kernels: Kernels = Kernels()) -> int:
    """The MLP's saved tensors between its projections.

    Eager: gated keeps gate, up, act(gate) and the product (the down projection's input);
    plain keeps the activation's input and output (the down projection's input).
    Compiled, or a fused activation kernel (Liger's SwiGLU), an element-wise output that is
    no matmul's input or output is recomputed in backward: act(gate) (gated); the plain MLP
    keeps both. A kernel that recomputes the product too (Unsloth's LoRA MLP, flash-attention's
    ``FusedMLP`` at ``checkpoint_lvl=1``) keeps only the first projections' outputs. A frozen down projection does
    not keep its input (``Kernels.keeps``)."""
    recompute_product = kernels.mlp == "fused-recompute"
    down_input = c * width if kernels.keeps("down_proj") and not recompute_product else 0
    if not gated:
        return c * width + down_input
    return (2 if kernels.mlp != "eager" else 3) * c * width + down_input


def _mlp_bytes(arch: Architecture, c: int, moe: bool, kernels: Kernels = Kernels()) -> int:
    h = arch.hidden
    mlp_input = c * h if kernels.keeps("gate_proj", "up_proj") else 0
    if not moe:
        return mlp_input + _mlp_core(arch.width, arch.gated_mlp, c, kernels)
    routed = arch.experts_per_token * (c * h + mlp_input + _mlp_core(arch.width, arch.gated_mlp, c, kernels))
    shared = _mlp_core(arch.shared_expert_width, arch.gated_mlp, c, kernels) if arch.shared_expert_width else 0
    return mlp_input + 4 * arch.experts + routed + shared


def _score_bytes(arch: Architecture, seq_len: int, c: int, autocast: bool) -> int:
    """Per-token bytes of the s×s matrices an unfused attention keeps.

    [Note: attention soft-capping]
    Gemma-2's eager attention caps the scores as ``tanh(scores / cap) * cap`` before the
    mask and the softmax (transformers' ``modeling_gemma2.eager_attention_forward``): the
    divisions and products by the constant save nothing (a Python scalar), ``tanh`` saves
    its output for its backward (``1 - tanh²``): one more s×s matrix per head, in the
    dtype the score matmul ran in (c; under autocast the matmul's 16-bit output, tanh is
    not an autocast fp32 op). Fused kernels that cap (flash-attention's ``softcap``,
    FlexAttention's ``score_mod``) keep no s×s matrix at all."""
    softmax = (4 if autocast else c) * arch.heads * seq_len
    softcap = c * arch.heads * seq_len if arch.attention_softcap else 0
    if not arch.dropout:
        return softmax + softcap
    return softmax + softcap + arch.heads * seq_len + c * arch.heads * seq_len  # mask, then the dropped copy


def _kv_saved_heads(arch: Architecture, store_scores: bool) -> int:
    """Heads of the k and v an attention keeps: an unfused (matmul) attention under GQA
    keeps the copies ``repeat_kv`` expands to every query head, the fused kernels take the
    kv heads as they are."""
    return arch.heads if store_scores else arch.kv


def layer_bytes(arch: Architecture, seq_len: int, c: int, *, store_scores: bool, moe: bool = False,
                autocast: bool = False, kernels: Kernels = Kernels()) -> int:
    """Bytes one layer saves for backward, per token.

    ``kernels``: fused norms, compiled element-wise ops, frozen projections whose
    inputs are not kept, and what LoRA adapters add (``kernels.py``, ``finetune.py``)."""
    h, d = arch.hidden, arch.dim
    masks = 2 * h if arch.dropout else 0
    qkv_input = c * h if kernels.keeps("q_proj", "k_proj", "v_proj") else 0
    out_input = c * arch.heads * d if kernels.keeps("o_proj") else 0
    attention = qkv_input + c * (arch.heads * d + 2 * _kv_saved_heads(arch, store_scores) * d) + out_input
    scores = _score_bytes(arch, seq_len, c, autocast) if store_scores else 0
    norms = arch.norms_per_layer * _norm_bytes(arch, c, autocast, kernels) + _qk_norm_bytes(arch, c, autocast, kernels)
    adapters = kernels.adapters.activation_bytes_per_token(arch, c, moe) if kernels.adapters else 0
    if arch.cross_attention:
        # a decoder layer of an encoder-decoder attends again, to the encoder's output (source
        # length = target length): its query input, q/k/v, out-projection input, scores and
        # output dropout; its norm is one of norms_per_layer
        attention, scores, masks = 2 * attention, 2 * scores, masks + (h if arch.dropout else 0)
    return norms + attention + scores + _mlp_bytes(arch, c, moe, kernels) + masks + adapters


def matmul_output_bytes(arch: Architecture, c: int, moe: bool = False) -> list[int]:
    """Per-token bytes of each matmul's output in one layer, in execution order.

    q, k, v, o, then the MLP: gate, up, down (gated) or up, down (plain); an MoE
    layer's router and its chosen experts' projections count per routed token.
    """
    h, d, f = arch.hidden, arch.dim, arch.width
    attention = [c * arch.heads * d, c * arch.kv * d, c * arch.kv * d, c * h]
    mlp = [c * f, c * f, c * h] if arch.gated_mlp else [c * f, c * h]
    if moe:
        k = arch.experts_per_token
        mlp = [4 * arch.experts] + [k * size for size in mlp]
        if arch.shared_expert_width:
            s = arch.shared_expert_width
            mlp += [c * s, c * s, c * h] if arch.gated_mlp else [c * s, c * h]
    return attention + mlp


def _layer_policy_bytes(arch: Architecture, inputs: ActivationInputs, policy: CheckpointPolicy,
                        moe: bool) -> tuple[int, int]:
    """(stored, full) bytes per token of one layer under ``policy``."""
    c, s, k = inputs.compute_bytes, inputs.seq_len, inputs.kernels
    keeps_scores = not inputs.fused_attention and policy.keeps_attention_scores
    full = layer_bytes(arch, s, c, store_scores=not inputs.fused_attention, moe=moe, autocast=inputs.autocast,
                       kernels=k)
    if policy.kind == "none":
        return full, full
    if policy.kind == "selective":
        return layer_bytes(arch, s, c, store_scores=keeps_scores, moe=moe, autocast=inputs.autocast, kernels=k), full
    layer_input = (4 if inputs.autocast else c) * arch.hidden
    if policy.kind == "mm":
        kept = matmul_output_bytes(arch, c, moe)[policy.mm_offset::policy.mm_stride]
        attention_output = c * arch.heads * arch.dim
        return min(full, layer_input + sum(kept) + attention_output), full
    return layer_input, full  # "full" and the checkpointed layers of "every-k"


def activation_profile(arch: Architecture, inputs: ActivationInputs) -> ActivationProfile:
    """Stored activations of all layers, and the recompute extra, for one micro-batch.

    >>> arch = Architecture(layers=32, hidden=4096, heads=32, vocab=32000)
    >>> p = activation_profile(arch, ActivationInputs(1, 4096, "full"))
    >>> (p.stored + p.recompute) / 2**30
    1.5625
    """
    if arch.encoder is not None:
        return _plus(activation_profile(arch.encoder, inputs), activation_profile(replace(arch, encoder=None), inputs))
    policy = parse_policy(inputs.checkpointing)
    tokens = inputs.tokens
    moe_layers = arch.moe_layer_count
    stored = recompute = largest_layer = 0
    for moe, count in ((True, moe_layers), (False, arch.layers - moe_layers)):
        if count == 0:
            continue
        kept, full = _layer_policy_bytes(arch, inputs, policy, moe)
        checkpointed = policy.checkpointed_layers(count)
        stored += tokens * (checkpointed * kept + (count - checkpointed) * full)
        largest_layer = max(largest_layer, tokens * (kept if checkpointed == count else full))
        if checkpointed and policy.kind != "none":
            recompute = max(recompute, tokens * (full - kept))
    if inputs.offload:
        # [Note: activation offloading] torchtune's OffloadActivations (saved-tensor hooks
        # around the model's forward) copies each saved tensor to pinned host memory on a
        # side stream and brings it back before its backward: a layer being offloaded and
        # one being prefetched stay on the device; the model's own outside tensors go too.
        kept = stored + tokens * _outside_bytes(arch, inputs)
        on_device = min(stored, 2 * largest_layer)
        return ActivationProfile(on_device, recompute, host=kept - on_device)
    return ActivationProfile(stored + tokens * _outside_bytes(arch, inputs), recompute)


def _plus(encoder: ActivationProfile, decoder: ActivationProfile) -> ActivationProfile:
    """An encoder-decoder: both stacks' kept activations; one layer is recomputed at a time."""
    return ActivationProfile(encoder.stored + decoder.stored, max(encoder.recompute, decoder.recompute),
                             host=encoder.host + decoder.host)


def _outside_bytes(arch: Architecture, inputs: ActivationInputs) -> int:
    """The final norm's saved input and the LM head's input, per token."""
    return _norm_bytes(arch, inputs.compute_bytes, inputs.autocast, inputs.kernels) + inputs.compute_bytes * arch.hidden


def activation_bytes(arch: Architecture, inputs: ActivationInputs) -> int:
    """Peak activation bytes of all layers for one micro-batch (stored + recompute).

    >>> arch = Architecture(layers=32, hidden=4096, heads=32, vocab=32000)
    >>> activation_bytes(arch, ActivationInputs(1, 4096, "none")) / 2**30
    17.0625
    """
    return activation_profile(arch, inputs).peak


def layer_activation_bytes(arch: Architecture, micro_batch: int, seq_len: int, *, store_scores: bool) -> int:
    """16-bit bytes one layer keeps for backward; ``store_scores`` keeps the s×s matrices.

    >>> layer_activation_bytes(Architecture(1, 4096, 32, 32000), 1, 4096, store_scores=False) / 2**20
    544.0
    """
    return micro_batch * seq_len * layer_bytes(arch, seq_len, 2, store_scores=store_scores)


def logits_loss_bytes(vocab: int, micro_batch: int, seq_len: int, compute_bytes: int = 2) -> int:
    """Logits and cross-entropy buffers at the start of backward, per micro-batch.

    The LM head writes c-byte logits; the loss upcasts them and ``log_softmax`` saves
    its fp32 output; the loss's backward then holds the fp32 gradient of the
    log-probabilities and of the logits at once: ``(12 + c)·b·s·V`` bytes. Kept apart
    from the layers because it scales with the vocabulary, not h, and is freed before
    any checkpointed layer is recomputed.

    >>> logits_loss_bytes(32000, 1, 1024) / 2**20
    437.5
    """
    return (12 + compute_bytes) * micro_batch * seq_len * vocab
