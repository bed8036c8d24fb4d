"""Hand-written model families: the tensor shapes of a Hugging Face config, without transformers.

Each family describes its decoder (or encoder) blocks — one tally per kind of block,
with how many there are (MoE stacks mix dense and sparse blocks) — plus the tensors
outside the blocks. Counting shapes (rather than a closed formula) gives the exact
total, the largest stage-3 unit, the largest tensor and Adafactor's factored state
from one description; ``tests/estimator/test_estimator_configs.py`` checks every family against
published totals and against transformers' own meta-device build.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import EstimatorInputError
from .config_defaults import note_missing
from .stats import Architecture, check_count, factored_numel


@dataclass
class ShapeTally:
    """Tensor shapes, each with how many times it occurs."""

    shapes: list[tuple[tuple[int, ...], int]] = field(default_factory=list)

    def add(self, *shape: int, times: int = 1) -> None:
        self.shapes.append((tuple(shape), times))

    def linear(self, fan_in: int, fan_out: int, *, bias: bool, times: int = 1) -> None:
        self.add(fan_out, fan_in, times=times)
        if bias:
            self.add(fan_out, times=times)

    def norm(self, width: int, *, bias: bool) -> None:
        # RMSNorm has a weight only; LayerNorm has weight and bias.
        self.add(width, times=2 if bias else 1)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) * times for shape, times in self.shapes)

    @property
    def factored_numel(self) -> int:
        return sum(factored_numel(shape) * times for shape, times in self.shapes)

    @property
    def largest_tensor(self) -> int:
        return max((math.prod(shape) for shape, _ in self.shapes), default=0)


@dataclass(frozen=True)
class Layout:
    """The blocks (tally, count), the tensors outside them, and the facts for activations."""

    blocks: tuple[tuple[ShapeTally, int], ...]
    outside: ShapeTally
    largest_outside_unit: int  # the embedding (or untied head), gathered as its own unit
    architecture: Architecture


def get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """First present key among aliases (GPT-2 says n_embd where Llama says hidden_size)."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if default is None:
        raise EstimatorInputError(f"config is missing {keys[0]!r}")
    if not any(key in config for key in keys):
        note_missing(config, keys)  # transformers' default fills it when it is importable
    return default


def integer(config: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    return check_count(keys[0], get(config, *keys, default=default))


def attention_dims(config: Mapping[str, Any], *, kv_default: int | None = None,
                   head_dim_default: int | None = None) -> tuple[int, int, int, int]:
    """(hidden, heads, kv_heads, head_dim); GQA when kv_heads < heads.

    An omitted ``num_key_value_heads`` / ``head_dim`` takes the family's config-class default:
    the head count and hidden/heads unless the family's class says a number (Mistral's 8 kv heads,
    Qwen3's head_dim of 128)."""
    hidden = integer(config, "hidden_size", "n_embd", "d_model")
    heads = integer(config, "num_attention_heads", "n_head")
    kv_heads = integer(config, "num_key_value_heads", "num_kv_heads", default=kv_default or heads)
    head_dim = integer(config, "head_dim", default=head_dim_default or max(1, hidden // heads))
    if kv_heads > heads or heads % kv_heads:
        # grouped-query attention shares each key-value head among heads/kv query heads
        stated = any(key in config for key in ("num_key_value_heads", "num_kv_heads"))
        raise EstimatorInputError(
            f"num_key_value_heads = {kv_heads} " + ("exceeds" if kv_heads > heads else "must divide")
            + f" num_attention_heads = {heads} (each key-value head serves a whole group of query heads)"
            + ("" if stated else
            f"; the config omits it and {config.get('model_type')}'s config class defaults it to {kv_heads}: "
            "state num_key_value_heads"))
    return hidden, heads, kv_heads, head_dim


def attention(tally: ShapeTally, hidden: int, heads: int, kv_heads: int, head_dim: int,
              *, qkv_bias: bool, out_bias: bool) -> None:
    tally.linear(hidden, heads * head_dim, bias=qkv_bias)
    tally.linear(hidden, kv_heads * head_dim, bias=qkv_bias, times=2)
    tally.linear(heads * head_dim, hidden, bias=out_bias)


def gated_mlp(tally: ShapeTally, hidden: int, width: int, *, bias: bool = False) -> None:
    tally.linear(hidden, width, bias=bias, times=2)  # gate and up
    tally.linear(width, hidden, bias=bias)           # down


def plain_mlp(tally: ShapeTally, hidden: int, width: int, *, bias: bool = True) -> None:
    tally.linear(hidden, width, bias=bias)
    tally.linear(width, hidden, bias=bias)


def embeddings(config: Mapping[str, Any], hidden: int, *, head_bias: bool = False,
               tied_default: bool) -> tuple[ShapeTally, int]:
    """Token embedding plus the LM head when untied (tied weights are counted once)."""
    vocab = integer(config, "vocab_size")
    tally = ShapeTally()
    tally.add(vocab, hidden)
    if not bool(config.get("tie_word_embeddings", tied_default)):
        tally.linear(hidden, vocab, bias=head_bias)
    elif head_bias:
        tally.add(vocab)  # tying shares the weight only: the head keeps its own bias (Phi)
    return tally, vocab * hidden


def layers(config: Mapping[str, Any]) -> int:
    return integer(config, "num_hidden_layers", "n_layer")


# The config classes whose dropout is on by default (every other family's defaults are 0.0).
_DROPOUT_DEFAULTS = {"gpt2": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
                     "opt": {"dropout": 0.1}, "bert": {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}}


def has_dropout(config: Mapping[str, Any]) -> bool:
    keys = ("hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout", "attention_dropout",
            "attn_pdrop", "attention_probs_dropout_prob", "embd_pdrop", "residual_dropout", "dropout_rate")
    defaults = _DROPOUT_DEFAULTS.get(str(config.get("model_type")), {})
    rates = [config[key] if key in config else defaults.get(key) for key in keys]
    return any(isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0 for rate in rates)


CHECKPOINT_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def checkpoint_bytes(config: Mapping[str, Any]) -> int | None:
    """Bytes per element of the dtype the checkpoint says it holds (``torch_dtype``, ``dtype`` since
    transformers 4.56; None when unstated or not a float dtype): Unsloth casts the logits to it.

    >>> checkpoint_bytes({"torch_dtype": "float32"}), checkpoint_bytes({})
    (4, None)
    """
    stated = config.get("torch_dtype", config.get("dtype"))
    return CHECKPOINT_DTYPES.get(str(stated).removeprefix("torch.")) if stated is not None else None


def softcaps(config: Mapping[str, Any], defaults: Mapping[str, float] | None = None) -> dict[str, bool]:
    """Which soft-caps the config turns on (a number; ``null`` turns a family's default off).

    >>> softcaps({"final_logit_softcapping": 30.0}), softcaps({}, GEMMA2_SOFTCAPS)["attention_softcap"]
    ({'attention_softcap': False, 'logit_softcap': True}, True)
    """
    def on(key: str) -> bool:
        return config.get(key, (defaults or {}).get(key)) is not None
    return {"attention_softcap": on("attn_logit_softcapping"), "logit_softcap": on("final_logit_softcapping")}


GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # Gemma2Config's defaults


def arch(config: Mapping[str, Any], hidden: int, heads: int, *, kv_heads: int | None = None,
         head_dim: int | None = None, width: int | None = None, gated: bool = False, norm: str = "layernorm",
         norms: int = 2, softcap_defaults: Mapping[str, float] | None = None, **facts: Any) -> Architecture:
    return Architecture(layers(config), hidden, heads, integer(config, "vocab_size"), kv_heads=kv_heads,
                        head_dim=head_dim, mlp_width=width, gated_mlp=gated, norm=norm, norms_per_layer=norms,
                        dropout=has_dropout(config), checkpoint_bytes=checkpoint_bytes(config),
                        **softcaps(config, softcap_defaults), **facts)


def decoder(config: Mapping[str, Any], blocks: tuple[tuple[ShapeTally, int], ...], architecture: Architecture,
            *, final_norm: str | None = "rms", tied_default: bool = False, head_bias: bool = False) -> Layout:
    """A decoder: the blocks, the token embedding (plus an untied head) and a final norm
    (``"rms"``: weight only, ``"layer"``: weight and bias, None: no parameters)."""
    outside, embedding = embeddings(config, architecture.hidden, head_bias=head_bias, tied_default=tied_default)
    if final_norm:
        outside.norm(architecture.hidden, bias=final_norm == "layer")
    return Layout(blocks, outside, embedding, architecture)


# ---------------------------------------------------------------------- Llama-like


def llama_like(config: Mapping[str, Any], *, qkv_bias: bool, out_bias: bool, tied_default: bool,
               experts: int = 0, qk_norm: bool = False, norms: int = 2, kv_default: int | None = None,
               head_dim_default: int | None = None,
               softcap_defaults: Mapping[str, float] | None = None) -> Layout:
    """Llama, Mistral, Qwen2/3, Gemma/Gemma-2, Mixtral: RMSNorm, rotary, gated MLP."""
    hidden, heads, kv_heads, head_dim = attention_dims(config, kv_default=kv_default,
                                                       head_dim_default=head_dim_default)
    intermediate = integer(config, "intermediate_size")
    mlp_bias = bool(config.get("mlp_bias", False))
    block = ShapeTally()
    attention(block, hidden, heads, kv_heads, head_dim, qkv_bias=qkv_bias, out_bias=out_bias)
    if qk_norm:
        block.norm(head_dim, bias=False)
        block.norm(head_dim, bias=False)
    for _ in range(max(experts, 1)):
        gated_mlp(block, hidden, intermediate, bias=mlp_bias)
    if experts:
        block.linear(hidden, experts, bias=False)                   # router
    for _ in range(norms):
        block.norm(hidden, bias=False)
    moe = dict(experts=experts, experts_per_token=experts_per_token(config, experts)) if experts else {}
    return decoder(config, ((block, layers(config)),),
                   arch(config, hidden, heads, kv_heads=kv_heads, head_dim=head_dim, width=intermediate,
                        gated=True, norm="rmsnorm", norms=norms, qk_norm=qk_norm,
                        softcap_defaults=softcap_defaults, **moe), tied_default=tied_default)


def experts_per_token(config: Mapping[str, Any], experts: int) -> int:
    """The router's top-k, which cannot exceed the experts it chooses among."""
    top_k = integer(config, "num_experts_per_tok")
    if top_k > experts:
        raise EstimatorInputError(f"num_experts_per_tok = {top_k} exceeds the {experts} experts a token is routed "
                                  "among")
    return top_k


def llama(config: Mapping[str, Any]) -> Layout:
    # Llama's attention_bias puts a bias on q, k, v and o alike; Mistral has no such key.
    bias = bool(config.get("attention_bias", False))
    return llama_like(config, qkv_bias=bias, out_bias=bias, tied_default=False)


def mistral(config: Mapping[str, Any]) -> Layout:
    # Llama's shapes; MistralConfig's own default of 8 key-value heads.
    return llama_like(config, qkv_bias=False, out_bias=False, tied_default=False, kv_default=8)


def qwen2(config: Mapping[str, Any]) -> Layout:
    # Qwen2 always has biases on q/k/v and never on the output projection.
    return llama_like(config, qkv_bias=True, out_bias=False, tied_default=False, kv_default=32)


def qwen3(config: Mapping[str, Any]) -> Layout:
    # Qwen3 drops Qwen2's q/k/v biases (attention_bias, default off) and adds RMSNorms
    # over each head's queries and keys; Qwen3Config says head_dim 128 whatever hidden/heads is.
    bias = bool(config.get("attention_bias", False))
    return llama_like(config, qkv_bias=bias, out_bias=bias, tied_default=False, qk_norm=True, kv_default=32,
                      head_dim_default=128)


def gemma(config: Mapping[str, Any]) -> Layout:
    # Gemma ties embeddings by default and sets head_dim explicitly (256 ≠ h/a for 7B).
    bias = bool(config.get("attention_bias", False))
    return llama_like(config, qkv_bias=bias, out_bias=bias, tied_default=True, kv_default=16, head_dim_default=256)


def gemma2(config: Mapping[str, Any]) -> Layout:
    # Gemma-2 wraps both attention and MLP in pre- and post-norms: four per block.
    bias = bool(config.get("attention_bias", False))
    return llama_like(config, qkv_bias=bias, out_bias=bias, tied_default=True, norms=4, kv_default=4,
                      head_dim_default=256, softcap_defaults=GEMMA2_SOFTCAPS)


def mixtral(config: Mapping[str, Any]) -> Layout:
    # Each of the E experts is a full gated MLP; the router is a bias-free h×E linear.
    return llama_like(config, qkv_bias=False, out_bias=False, tied_default=False, kv_default=8,
                      experts=integer(config, "num_local_experts"))


def phi3(config: Mapping[str, Any]) -> Layout:
    """Phi-3: fused qkv_proj and gate_up_proj without biases, RMSNorm, untied head."""
    hidden, heads, kv_heads, head_dim = attention_dims(config)
    intermediate = integer(config, "intermediate_size")
    block = ShapeTally()
    block.linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
    block.linear(heads * head_dim, hidden, bias=False)
    block.linear(hidden, 2 * intermediate, bias=False)
    block.linear(intermediate, hidden, bias=False)
    block.norm(hidden, bias=False)
    block.norm(hidden, bias=False)
    return decoder(config, ((block, layers(config)),),
                   arch(config, hidden, heads, kv_heads=kv_heads, head_dim=head_dim, width=intermediate,
                        gated=True, norm="rmsnorm"))


def olmo(config: Mapping[str, Any]) -> Layout:
    """OLMo: LayerNorms without parameters, no biases, gated MLP."""
    hidden, heads, kv_heads, head_dim = attention_dims(config)
    intermediate = integer(config, "intermediate_size")
    bias = bool(config.get("attention_bias", False))
    block = ShapeTally()
    attention(block, hidden, heads, kv_heads, head_dim, qkv_bias=bias, out_bias=bias)
    gated_mlp(block, hidden, intermediate)
    return decoder(config, ((block, layers(config)),),
                   arch(config, hidden, heads, kv_heads=kv_heads, head_dim=head_dim, width=intermediate, gated=True),
                   final_norm=None)


def olmo2(config: Mapping[str, Any]) -> Layout:
    """OLMo-2: post-attention and post-MLP RMSNorms, and RMSNorms over the full q and k."""
    hidden, heads, kv_heads, head_dim = attention_dims(config)
    intermediate = integer(config, "intermediate_size")
    bias = bool(config.get("attention_bias", False))
    block = ShapeTally()
    attention(block, hidden, heads, kv_heads, head_dim, qkv_bias=bias, out_bias=bias)
    block.norm(heads * head_dim, bias=False)
    block.norm(kv_heads * head_dim, bias=False)
    gated_mlp(block, hidden, intermediate)
    block.norm(hidden, bias=False)
    block.norm(hidden, bias=False)
    return decoder(config, ((block, layers(config)),),
                   arch(config, hidden, heads, kv_heads=kv_heads, head_dim=head_dim, width=intermediate,
                        gated=True, norm="rmsnorm", qk_norm=True))


FamilyFn = Callable[[Mapping[str, Any]], Layout]
