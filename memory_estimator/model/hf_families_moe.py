"""Hand-written mixture-of-experts families: Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3
(multi-head latent attention, shared plus routed experts, leading dense layers)."""
from __future__ import annotations

from typing import Any, Mapping

from .hf_families import Layout, ShapeTally, arch, attention, attention_dims, decoder, gated_mlp, integer, layers


def _sparse_layers(config: Mapping[str, Any], experts: int) -> int:
    """Qwen-MoE's rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th."""
    step = integer(config, "decoder_sparse_step", default=1)
    dense_only = set(config.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers(config)) if experts and i not in dense_only and (i + 1) % step == 0)


def _qwen_moe(config: Mapping[str, Any], *, qkv_bias: bool, qk_norm: bool, shared: bool) -> Layout:
    hidden, heads, kv_heads, head_dim = attention_dims(config)
    experts = integer(config, *_EXPERTS)
    expert_width = integer(config, "moe_intermediate_size")
    common = ShapeTally()
    attention(common, hidden, heads, kv_heads, head_dim, qkv_bias=qkv_bias, out_bias=False)
    if qk_norm:
        common.norm(head_dim, bias=False)
        common.norm(head_dim, bias=False)
    common.norm(hidden, bias=False)
    common.norm(hidden, bias=False)
    sparse = ShapeTally(list(common.shapes))
    sparse.linear(hidden, experts, bias=False)                        # router
    for _ in range(experts):
        gated_mlp(sparse, hidden, expert_width)
    shared_width = integer(config, "shared_expert_intermediate_size") if shared else 0
    if shared:
        gated_mlp(sparse, hidden, shared_width)
        sparse.linear(hidden, 1, bias=False)                          # shared_expert_gate
    dense = ShapeTally(list(common.shapes))
    gated_mlp(dense, hidden, integer(config, "intermediate_size"))
    return _moe_decoder(config, sparse, dense, _sparse_layers(config, experts), hidden, heads,
                        kv_heads=kv_heads, head_dim=head_dim, width=expert_width, shared_expert_width=shared_width,
                        qk_norm=qk_norm)


def _moe_decoder(config: Mapping[str, Any], sparse: ShapeTally, dense: ShapeTally, n_sparse: int, hidden: int,
                 heads: int, **facts: Any) -> Layout:
    """Sparse and dense blocks, an untied head and a final RMSNorm."""
    architecture = arch(config, hidden, heads, gated=True, norm="rmsnorm", experts=integer(config, *_EXPERTS),
                        experts_per_token=integer(config, "num_experts_per_tok"), moe_layers=n_sparse, **facts)
    return decoder(config, ((sparse, n_sparse), (dense, layers(config) - n_sparse)), architecture)


# transformers 5.x writes Qwen-MoE's expert count as num_local_experts (4.x: num_experts).
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def qwen2_moe(config: Mapping[str, Any]) -> Layout:
    # Qwen2's q/k/v biases; one always-on shared expert with a sigmoid gate.
    return _qwen_moe(config, qkv_bias=True, qk_norm=False, shared=True)


def qwen3_moe(config: Mapping[str, Any]) -> Layout:
    # Qwen3's q/k norms and no biases; no shared expert.
    return _qwen_moe(config, qkv_bias=bool(config.get("attention_bias", False)), qk_norm=True, shared=False)


def _latent_attention(block: ShapeTally, config: Mapping[str, Any], hidden: int, heads: int) -> int:
    """DeepSeek's multi-head latent attention; returns the query/key head width."""
    nope, rope = integer(config, "qk_nope_head_dim"), integer(config, "qk_rope_head_dim")
    v_dim, kv_rank = integer(config, "v_head_dim"), integer(config, "kv_lora_rank")
    bias = bool(config.get("attention_bias", False))
    q_rank = config.get("q_lora_rank")
    if q_rank:
        block.linear(hidden, q_rank, bias=bias)
        block.norm(q_rank, bias=False)
        block.linear(q_rank, heads * (nope + rope), bias=False)
    else:
        block.linear(hidden, heads * (nope + rope), bias=False)
    block.linear(hidden, kv_rank + rope, bias=bias)
    block.norm(kv_rank, bias=False)
    block.linear(kv_rank, heads * (nope + v_dim), bias=False)
    block.linear(heads * v_dim, hidden, bias=bias)
    return nope + rope


def deepseek(config: Mapping[str, Any]) -> Layout:
    """DeepSeek-V2/V3: latent attention; the first ``first_k_dense_replace`` layers dense,
    then MoE layers every ``moe_layer_freq``: a router, routed experts and shared experts."""
    hidden = integer(config, "hidden_size")
    heads = integer(config, "num_attention_heads")
    experts = integer(config, "n_routed_experts")
    expert_width = integer(config, "moe_intermediate_size")
    shared_width = expert_width * integer(config, "n_shared_experts", default=1)
    common = ShapeTally()
    head_dim = _latent_attention(common, config, hidden, heads)
    common.norm(hidden, bias=False)
    common.norm(hidden, bias=False)
    sparse = ShapeTally(list(common.shapes))
    sparse.add(experts, hidden)                                       # router weight
    for _ in range(experts):
        gated_mlp(sparse, hidden, expert_width)
    gated_mlp(sparse, hidden, shared_width)
    dense = ShapeTally(list(common.shapes))
    gated_mlp(dense, hidden, integer(config, "intermediate_size"))
    first_dense = integer(config, "first_k_dense_replace", default=0) if config.get("first_k_dense_replace") else 0
    freq = integer(config, "moe_layer_freq", default=1)
    n_sparse = sum(1 for i in range(layers(config)) if i >= first_dense and i % freq == 0)
    return _moe_decoder(config, sparse, dense, n_sparse, hidden, heads, head_dim=head_dim, width=expert_width,
                        shared_expert_width=shared_width)
