"""Exact parameter counts from a Hugging Face-style ``config.json``, read as plain JSON.

Each family is described by the tensor shapes of one decoder block plus the tensors
outside the blocks; counting shapes (rather than a closed formula) gives the exact
total, the largest stage-3 unit and Adafactor's factored state from one description.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import EstimatorInputError
from .stats import Architecture, ModelStats, check_count, factored_numel


@dataclass
class _ShapeTally:
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


@dataclass(frozen=True)
class _Layout:
    """One block, the tensors outside the blocks, and the facts for activations."""

    block: _ShapeTally
    outside: _ShapeTally
    largest_outside_unit: int  # the embedding (or untied head), gathered as its own unit
    architecture: Architecture


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """First present key among aliases (GPT-2 says n_embd where Llama says hidden_size)."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if default is None:
        raise EstimatorInputError(f"config is missing {keys[0]!r}")
    return default


def _int(config: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    return check_count(keys[0], _get(config, *keys, default=default))


def _attention_dims(config: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(hidden, heads, kv_heads, head_dim); GQA when kv_heads < heads."""
    hidden = _int(config, "hidden_size", "n_embd", "d_model")
    heads = _int(config, "num_attention_heads", "n_head")
    kv_heads = _int(config, "num_key_value_heads", default=heads)
    head_dim = _int(config, "head_dim", default=max(1, hidden // heads))
    return hidden, heads, kv_heads, head_dim


def _attention(tally: _ShapeTally, hidden: int, heads: int, kv_heads: int, head_dim: int,
               *, qkv_bias: bool, out_bias: bool) -> None:
    tally.linear(hidden, heads * head_dim, bias=qkv_bias)
    tally.linear(hidden, kv_heads * head_dim, bias=qkv_bias, times=2)
    tally.linear(heads * head_dim, hidden, bias=out_bias)


def _embeddings(config: Mapping[str, Any], hidden: int, *, head_bias: bool = False,
                tied_default: bool) -> tuple[_ShapeTally, int]:
    """Token embedding plus the LM head when untied (tied weights are counted once)."""
    vocab = _int(config, "vocab_size")
    tally = _ShapeTally()
    tally.add(vocab, hidden)
    if not bool(config.get("tie_word_embeddings", tied_default)):
        tally.linear(hidden, vocab, bias=head_bias)
    return tally, vocab * hidden


def _layers(config: Mapping[str, Any]) -> int:
    return _int(config, "num_hidden_layers", "n_layer")


def _llama_like(config: Mapping[str, Any], *, qkv_bias: bool, out_bias: bool, tied_default: bool,
                experts: int = 0) -> _Layout:
    """Llama, Mistral, Qwen2, Gemma, Mixtral: RMSNorm, rotary, gated MLP (gate/up/down)."""
    hidden, heads, kv_heads, head_dim = _attention_dims(config)
    intermediate = _int(config, "intermediate_size")
    mlp_bias = bool(config.get("mlp_bias", False))
    block = _ShapeTally()
    _attention(block, hidden, heads, kv_heads, head_dim, qkv_bias=qkv_bias, out_bias=out_bias)
    for _ in range(max(experts, 1)):
        block.linear(hidden, intermediate, bias=mlp_bias, times=2)  # gate and up
        block.linear(intermediate, hidden, bias=mlp_bias)           # down
    if experts:
        block.linear(hidden, experts, bias=False)                   # router
    block.norm(hidden, bias=False)
    block.norm(hidden, bias=False)
    outside, embedding = _embeddings(config, hidden, tied_default=tied_default)
    outside.norm(hidden, bias=False)
    return _Layout(block, outside, embedding,
                   Architecture(_layers(config), hidden, heads, _int(config, "vocab_size")))


def _llama(config: Mapping[str, Any]) -> _Layout:
    # Llama's attention_bias puts a bias on q, k, v and o alike; Mistral has no such key.
    bias = bool(config.get("attention_bias", False))
    return _llama_like(config, qkv_bias=bias, out_bias=bias, tied_default=False)


def _qwen2(config: Mapping[str, Any]) -> _Layout:
    # Qwen2 always has biases on q/k/v and never on the output projection.
    return _llama_like(config, qkv_bias=True, out_bias=False, tied_default=False)


def _gemma(config: Mapping[str, Any]) -> _Layout:
    # Gemma ties embeddings by default and sets head_dim explicitly (256 ≠ h/a for 7B).
    bias = bool(config.get("attention_bias", False))
    return _llama_like(config, qkv_bias=bias, out_bias=bias, tied_default=True)


def _mixtral(config: Mapping[str, Any]) -> _Layout:
    # Each of the E experts is a full gated MLP; the router is a bias-free h×E linear.
    return _llama_like(config, qkv_bias=False, out_bias=False, tied_default=False,
                       experts=_int(config, "num_local_experts"))


def _gpt2(config: Mapping[str, Any]) -> _Layout:
    """GPT-2: learned positions, fused QKV with bias, 4h MLP with bias, LayerNorm, tied head."""
    hidden = _int(config, "n_embd", "hidden_size")
    heads = _int(config, "n_head", "num_attention_heads")
    inner = _int(config, "n_inner", default=4 * hidden)
    block = _ShapeTally()
    block.norm(hidden, bias=True)
    block.linear(hidden, 3 * hidden, bias=True)
    block.linear(hidden, hidden, bias=True)
    block.norm(hidden, bias=True)
    block.linear(hidden, inner, bias=True)
    block.linear(inner, hidden, bias=True)
    outside, embedding = _embeddings(config, hidden, tied_default=True)
    outside.add(_int(config, "n_positions", "max_position_embeddings"), hidden)
    outside.norm(hidden, bias=True)
    return _Layout(block, outside, embedding,
                   Architecture(_layers(config), hidden, heads, _int(config, "vocab_size")))


def _gpt_neox(config: Mapping[str, Any]) -> _Layout:
    """GPT-NeoX / Pythia: fused QKV with bias, two LayerNorms, 4h MLP with bias, untied head."""
    hidden, heads, _, _ = _attention_dims(config)
    intermediate = _int(config, "intermediate_size", default=4 * hidden)
    bias = bool(config.get("attention_bias", True))
    block = _ShapeTally()
    block.norm(hidden, bias=True)
    block.norm(hidden, bias=True)
    block.linear(hidden, 3 * hidden, bias=bias)
    block.linear(hidden, hidden, bias=bias)
    block.linear(hidden, intermediate, bias=True)
    block.linear(intermediate, hidden, bias=True)
    outside, embedding = _embeddings(config, hidden, tied_default=False)
    outside.norm(hidden, bias=True)
    return _Layout(block, outside, embedding,
                   Architecture(_layers(config), hidden, heads, _int(config, "vocab_size")))


def _phi(config: Mapping[str, Any]) -> _Layout:
    """Phi-1/1.5/2: one LayerNorm per block (parallel attention and MLP), biases everywhere,
    partial rotary (no parameters), untied LM head with bias."""
    hidden, heads, kv_heads, head_dim = _attention_dims(config)
    intermediate = _int(config, "intermediate_size", default=4 * hidden)
    block = _ShapeTally()
    block.norm(hidden, bias=True)
    _attention(block, hidden, heads, kv_heads, head_dim, qkv_bias=True, out_bias=True)
    if config.get("qk_layernorm"):
        block.norm(head_dim, bias=True)
        block.norm(head_dim, bias=True)
    block.linear(hidden, intermediate, bias=True)
    block.linear(intermediate, hidden, bias=True)
    outside, embedding = _embeddings(config, hidden, head_bias=True, tied_default=False)
    outside.norm(hidden, bias=True)
    return _Layout(block, outside, embedding,
                   Architecture(_layers(config), hidden, heads, _int(config, "vocab_size")))


_FAMILIES: dict[str, Callable[[Mapping[str, Any]], _Layout]] = {
    "llama": _llama,
    "mistral": _llama,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "gemma": _gemma,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "phi": _phi,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


def read_config(path: str | Path) -> dict[str, Any]:
    """Load a config.json as a dict, with one-line errors for missing or malformed files."""
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    try:
        text = config_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EstimatorInputError(f"config file not found: {config_path}") from None
    except OSError as error:
        raise EstimatorInputError(f"cannot read config file {config_path}: {error.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise EstimatorInputError(
            f"malformed JSON in {config_path}: {error.msg} at line {error.lineno}") from None
    if not isinstance(config, dict):
        raise EstimatorInputError(f"{config_path} must hold a JSON object, not {type(config).__name__}")
    return config


def stats_from_config(config: Mapping[str, Any] | str | Path) -> ModelStats:
    """Exact unique parameter count and architecture facts from a HF-style config.

    >>> cfg = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
    ...        "n_embd": 768, "n_layer": 12, "n_head": 12}
    >>> stats_from_config(cfg).params
    124439808
    """
    if not isinstance(config, Mapping):
        config = read_config(config)
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise EstimatorInputError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    layout = _FAMILIES[model_type](config)
    layers = layout.architecture.layers
    params = layers * layout.block.numel + layout.outside.numel
    return ModelStats(
        params=params,
        largest_unit=max(layout.block.numel, layout.largest_outside_unit),
        architecture=layout.architecture,
        factored_state_numel=layers * layout.block.factored_numel + layout.outside.factored_numel,
        source=f"config:{model_type}",
    )
