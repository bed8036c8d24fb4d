"""Hand-written mixture-of-experts families: Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3
(multi-head latent attention, shared plus routed experts, leading dense layers)."""
from __future__ import annotations

from typing import Any, Mapping

from .hf_families import (Layout, ShapeTally, arch, attention, attention_dims, decoder, experts_per_token, gated_mlp,
                          get, integer, layers)
from .stats import check_count


def _sparse_layers(config: Mapping[str, Any], experts: int) -> int:
    """Qwen-MoE's rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th."""
    step = integer(config, "decoder_sparse_step", default=1)
    dense_only = set(config.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers(config)) if experts and i not in dense_only and (i + 1) % step == 0)


def _qwen_moe(config: Mapping[str, Any], *, qkv_bias: bool, qk_norm: bool, shared: bool, kv_default: int) -> Layout:
    hidden, heads, kv_heads, head_dim = attention_dims(config, kv_default=kv_default)
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
    experts = integer(config, *_EXPERTS)
    architecture = arch(config, hidden, heads, gated=True, norm="rmsnorm", experts=experts,
                        experts_per_token=experts_per_token(config, experts), moe_layers=n_sparse, **facts)
    return decoder(config, ((sparse, n_sparse), (dense, layers(config) - n_sparse)), architecture)


# transformers 5.x writes Qwen-MoE's expert count as num_local_experts (4.x: num_experts).
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def qwen2_moe(config: Mapping[str, Any]) -> Layout:
    # Qwen2's q/k/v biases (Qwen2MoeConfig.qkv_bias, default on); one always-on shared expert
    # with a sigmoid gate.
    return _qwen_moe(config, qkv_bias=bool(config.get("qkv_bias", True)), qk_norm=False, shared=True, kv_default=16)


def qwen3_moe(config: Mapping[str, Any]) -> Layout:
    # Qwen3's q/k norms and no biases; no shared expert.
    return _qwen_moe(config, qkv_bias=bool(config.get("attention_bias", False)), qk_norm=True, shared=False,
                     kv_default=4)


def _latent_attention(block: ShapeTally, config: Mapping[str, Any], hidden: int, heads: int) -> int:
    """DeepSeek's multi-head latent attention; returns the query/key head width."""
    nope, rope = integer(config, "qk_nope_head_dim"), integer(config, "qk_rope_head_dim")
    v_dim, kv_rank = integer(config, "v_head_dim"), integer(config, "kv_lora_rank")
    bias = bool(config.get("attention_bias", False))
    q_rank = config.get("q_lora_rank", 1536)  # the config classes' default; an explicit null: no q compression
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


# DeepseekV2Config / DeepseekV3Config defaults for what a config may omit
_DEEPSEEK_DEFAULTS = {"deepseek_v2": {"n_shared_experts": 2, "first_k_dense_replace": 0},
                      "deepseek_v3": {"n_shared_experts": 1, "first_k_dense_replace": 3}}


def deepseek(config: Mapping[str, Any]) -> Layout:
    """DeepSeek-V2/V3: latent attention; the first ``first_k_dense_replace`` layers dense, every
    later one MoE: a router, routed experts and shared experts.

    ``moe_layer_freq`` is not read: transformers' DeepSeek-V2/V3 modeling makes every layer from
    ``first_k_dense_replace`` on an MoE layer whatever it says (the original remote code honoured it;
    every released checkpoint has 1, where the two agree)."""
    defaults = _DEEPSEEK_DEFAULTS[str(config.get("model_type"))]
    hidden = integer(config, "hidden_size")
    heads = integer(config, "num_attention_heads")
    experts = integer(config, "n_routed_experts")
    expert_width = integer(config, "moe_intermediate_size")
    # an explicit null means no shared experts (DeepSeek's own modeling code); omitted, the class default
    no_shared = "n_shared_experts" in config and config["n_shared_experts"] is None
    shared_width = 0 if no_shared else expert_width * integer(config, "n_shared_experts",
                                                               default=defaults["n_shared_experts"])
    common = ShapeTally()
    head_dim = _latent_attention(common, config, hidden, heads)
    common.norm(hidden, bias=False)
    common.norm(hidden, bias=False)
    sparse = ShapeTally(list(common.shapes))
    sparse.add(experts, hidden)                                       # router weight
    for _ in range(experts):
        gated_mlp(sparse, hidden, expert_width)
    if shared_width:
        gated_mlp(sparse, hidden, shared_width)
    dense = ShapeTally(list(common.shapes))
    gated_mlp(dense, hidden, integer(config, "intermediate_size"))
    first_dense = check_count("first_k_dense_replace",
                              get(config, "first_k_dense_replace", default=defaults["first_k_dense_replace"]),
                              minimum=0)
    n_sparse = max(0, layers(config) - first_dense)
    return _moe_decoder(config, sparse, dense, n_sparse, hidden, heads, head_dim=head_dim, width=expert_width,
                        shared_expert_width=shared_width)
