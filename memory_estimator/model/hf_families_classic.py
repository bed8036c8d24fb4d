"""Hand-written families with LayerNorm and plain (non-gated) MLPs: GPT-2, GPT-NeoX, Phi,
Falcon, OPT, BLOOM, StarCoder2 and BERT. Shapes follow each model's Hugging Face module."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from .hf_families import (Layout, ShapeTally, arch, attention, attention_dims, decoder, embeddings, get,
                          integer, layers, plain_mlp)


def gpt2(config: Mapping[str, Any]) -> Layout:
    """GPT-2: learned positions, fused QKV with bias, 4h MLP with bias, LayerNorm, tied head."""
    hidden = integer(config, "n_embd", "hidden_size")
    heads = integer(config, "n_head", "num_attention_heads")
    inner = integer(config, "n_inner", default=4 * hidden)
    block = ShapeTally()
    block.norm(hidden, bias=True)
    block.linear(hidden, 3 * hidden, bias=True)
    block.linear(hidden, hidden, bias=True)
    block.norm(hidden, bias=True)
    plain_mlp(block, hidden, inner)
    outside, embedding = embeddings(config, hidden, tied_default=True)
    outside.add(integer(config, "n_positions", "max_position_embeddings"), hidden)
    outside.norm(hidden, bias=True)
    return Layout(((block, layers(config)),), outside, embedding, arch(config, hidden, heads, width=inner))


def gpt_neox(config: Mapping[str, Any]) -> Layout:
    """GPT-NeoX / Pythia: fused QKV with bias, two LayerNorms, 4h MLP with bias, untied head."""
    hidden, heads, _, _ = attention_dims(config)
    intermediate = integer(config, "intermediate_size", default=24576)  # GPTNeoXConfig's default
    bias = bool(config.get("attention_bias", True))
    block = ShapeTally()
    block.norm(hidden, bias=True)
    block.norm(hidden, bias=True)
    block.linear(hidden, 3 * hidden, bias=bias)
    block.linear(hidden, hidden, bias=bias)
    plain_mlp(block, hidden, intermediate)
    return decoder(config, ((block, layers(config)),), arch(config, hidden, heads, width=intermediate),
                   final_norm="layer")


def phi(config: Mapping[str, Any]) -> Layout:
    """Phi-1/1.5/2: one LayerNorm per block (parallel attention and MLP), biases everywhere,
    partial rotary (no parameters), untied LM head with bias."""
    hidden, heads, kv_heads, head_dim = attention_dims(config)
    intermediate = integer(config, "intermediate_size", default=8192)  # PhiConfig's default
    block = ShapeTally()
    block.norm(hidden, bias=True)
    attention(block, hidden, heads, kv_heads, head_dim, qkv_bias=True, out_bias=True)
    if config.get("qk_layernorm"):
        block.norm(head_dim, bias=True)
        block.norm(head_dim, bias=True)
    plain_mlp(block, hidden, intermediate)
    return decoder(config, ((block, layers(config)),),
                   arch(config, hidden, heads, kv_heads=kv_heads, head_dim=head_dim, width=intermediate, norms=1),
                   final_norm="layer", head_bias=True)


def falcon(config: Mapping[str, Any]) -> Layout:
    """Falcon: fused QKV (multi-query for 7B, grouped for the new decoder architecture),
    parallel attention/MLP, 4h MLP, LayerNorms, tied head."""
    hidden = integer(config, "hidden_size")
    heads = integer(config, "num_attention_heads", "n_head")
    head_dim = hidden // heads
    new_arch = bool(config.get("new_decoder_architecture", False))
    if new_arch:
        kv_heads = integer(config, "num_kv_heads", default=heads)
    else:
        kv_heads = 1 if config.get("multi_query", True) else heads
    bias = bool(config.get("bias", False))
    width = integer(config, "ffn_hidden_size", default=4 * hidden)
    parallel = bool(config.get("parallel_attn", True))
    # FalconConfig's num_ln_in_parallel_attn=None means 2 under the new decoder architecture
    two_norms = config.get("num_ln_in_parallel_attn") in (None, 2)
    norms = 2 if new_arch and two_norms else (1 if parallel else 2)
    block = ShapeTally()
    for _ in range(norms):
        block.norm(hidden, bias=True)
    block.linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
    block.linear(hidden, hidden, bias=bias)
    plain_mlp(block, hidden, width, bias=bias)
    return decoder(config, ((block, layers(config)),),
                   arch(config, hidden, heads, kv_heads=kv_heads, head_dim=head_dim, width=width, norms=norms),
                   final_norm="layer", tied_default=True)


def opt(config: Mapping[str, Any]) -> Layout:
    """OPT: learned positions (offset by 2), q/k/v/o and fc1/fc2 with biases, LayerNorms,
    optional projections when the embedding width differs, tied head."""
    hidden = integer(config, "hidden_size")
    heads = integer(config, "num_attention_heads")
    width = integer(config, "ffn_dim")
    bias = bool(config.get("enable_bias", True))
    embed_dim = integer(config, "word_embed_proj_dim", default=hidden)
    affine = bool(config.get("layer_norm_elementwise_affine", True))  # False: LayerNorms without weights
    block = ShapeTally()
    _affine_norm(block, hidden, affine)
    attention(block, hidden, heads, heads, hidden // heads, qkv_bias=bias, out_bias=bias)
    _affine_norm(block, hidden, affine)
    plain_mlp(block, hidden, width, bias=bias)
    outside, embedding = embeddings(config, embed_dim, tied_default=True)
    outside.add(integer(config, "max_position_embeddings") + 2, hidden)
    if embed_dim != hidden:
        outside.linear(hidden, embed_dim, bias=False)  # project_out
        outside.linear(embed_dim, hidden, bias=False)  # project_in
    if config.get("do_layer_norm_before", True) and not config.get("_remove_final_layer_norm", False):
        _affine_norm(outside, hidden, affine)
    return Layout(((block, layers(config)),), outside, embedding, arch(config, hidden, heads, width=width))


def _affine_norm(tally: ShapeTally, width: int, affine: bool) -> None:
    if affine:
        tally.norm(width, bias=True)


def bloom(config: Mapping[str, Any]) -> Layout:
    """BLOOM: ALiBi (no position parameters), LayerNorm after the embedding, fused QKV with
    bias, 4h MLP with bias, tied head."""
    hidden = integer(config, "hidden_size", "n_embed")
    heads = integer(config, "n_head", "num_attention_heads")
    block = ShapeTally()
    block.norm(hidden, bias=True)
    block.linear(hidden, 3 * hidden, bias=True)
    block.linear(hidden, hidden, bias=True)
    block.norm(hidden, bias=True)
    plain_mlp(block, hidden, 4 * hidden)
    outside, embedding = embeddings(config, hidden, tied_default=True)
    outside.norm(hidden, bias=True)  # word_embeddings_layernorm
    outside.norm(hidden, bias=True)  # ln_f
    return Layout(((block, integer(config, "n_layer", "num_hidden_layers")),), outside, embedding,
                  arch({**config, "num_hidden_layers": integer(config, "n_layer", "num_hidden_layers")},
                       hidden, heads, width=4 * hidden))


def starcoder2(config: Mapping[str, Any]) -> Layout:
    """StarCoder2: GQA with biases, plain MLP (c_fc/c_proj) with biases, LayerNorms."""
    hidden, heads, kv_heads, head_dim = attention_dims(config, kv_default=2)
    width = integer(config, "intermediate_size")
    bias = bool(config.get("use_bias", True))
    block = ShapeTally()
    attention(block, hidden, heads, kv_heads, head_dim, qkv_bias=bias, out_bias=bias)
    plain_mlp(block, hidden, width, bias=bias)
    block.norm(hidden, bias=True)
    block.norm(hidden, bias=True)
    return decoder(config, ((block, layers(config)),),
                   arch(config, hidden, heads, kv_heads=kv_heads, head_dim=head_dim, width=width),
                   final_norm="layer", tied_default=True)


def bert(config: Mapping[str, Any]) -> Layout:
    """BERT: word, position and token-type embeddings with a LayerNorm, post-norm encoder
    blocks, a pooler, and the head its ``architectures`` names (masked LM, pre-training
    or sequence classification; BertModel alone has only the pooler)."""
    hidden = integer(config, "hidden_size")
    heads = integer(config, "num_attention_heads")
    width = integer(config, "intermediate_size", default=3072)  # BertConfig's default, whatever the width
    vocab = integer(config, "vocab_size")
    block = ShapeTally()
    attention(block, hidden, heads, heads, hidden // heads, qkv_bias=True, out_bias=True)
    block.norm(hidden, bias=True)
    plain_mlp(block, hidden, width)
    block.norm(hidden, bias=True)
    outside = ShapeTally()
    outside.add(vocab, hidden)
    outside.add(integer(config, "max_position_embeddings"), hidden)
    outside.add(integer(config, "type_vocab_size", default=2), hidden)
    outside.norm(hidden, bias=True)
    head = str((get(config, "architectures", default=["BertModel"]) or ["BertModel"])[0])
    lm_head = "MaskedLM" in head or "PreTraining" in head or "LMHead" in head
    if "SequenceClassification" in head or "PreTraining" in head or head == "BertModel":
        outside.linear(hidden, hidden, bias=True)  # pooler
    if lm_head:
        outside.linear(hidden, hidden, bias=True)  # prediction transform
        outside.norm(hidden, bias=True)
        outside.add(vocab)                         # decoder bias; its weight is the tied embedding
    if "PreTraining" in head:
        outside.linear(hidden, 2, bias=True)       # next-sentence head
    if "SequenceClassification" in head:
        labels = len(config.get("id2label") or {}) or integer(config, "num_labels", default=2)
        outside.linear(hidden, labels, bias=True)
    architecture = arch(config, hidden, heads, width=width)
    if not lm_head:
        architecture = replace(architecture, lm_head=False)
    return Layout(((block, layers(config)),), outside, vocab * hidden, architecture)
