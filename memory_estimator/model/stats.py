"""What the estimator needs to know about a model, whatever the input was."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import EstimatorInputError

# Above this many parameters an input is treated as a typo (1e9 vs 1e19), not a model.
MAX_PLAUSIBLE_PARAMS = 10**14


@dataclass(frozen=True)
class Architecture:
    """Transformer facts the activation formula needs (Korthikanti et al. 2022 notation).

    The defaults describe Korthikanti's GPT (4h MLP, LayerNorm, dropout, multi-head
    attention), for which the formula is exactly their ``34·sbh (+ 5·a·s²·b)``; configs
    fill in what their family really has (gated MLP width, GQA, MoE, RMSNorm).
    """

    layers: int                      # L
    hidden: int                      # h
    heads: int                       # a
    vocab: int                       # V, for the logits/loss buffers
    kv_heads: int | None = None      # GQA/MQA key-value heads (default a)
    head_dim: int | None = None      # default h / a
    mlp_width: int | None = None     # f, per expert for MoE (default 4h)
    gated_mlp: bool = False          # SwiGLU/GeGLU: gate, up and down projections
    experts: int = 0                 # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0       # top-k
    shared_expert_width: int = 0     # total width of always-on shared experts
    moe_layers: int | None = None    # how many layers are MoE (default all when experts)
    norm: str = "layernorm"          # "layernorm" or "rmsnorm" (fp32 upcast, as HF/Meta implement it)
    dropout: bool = True             # dropout active in training (GPT-2, BERT); modern LLMs have none
    norms_per_layer: int = 2         # 1 with parallel attention/MLP, 4 in Gemma-2's sandwich
    lm_head: bool = True             # per-token logits over the vocabulary (False: a classifier)
    checkpoint_bytes: int | None = None  # bytes per element of config.json's torch_dtype (None: not stated)
    qk_norm: bool = False            # norms over the queries and keys (Qwen3, Gemma-3, OLMo-2)
    attention_softcap: bool = False  # tanh soft-capping of the attention scores (Gemma-2's attn_logit_softcapping)
    logit_softcap: bool = False      # tanh soft-capping of the logits (Gemma-2's final_logit_softcapping)
    cross_attention: bool = False    # each layer also attends to an encoder's output (T5's decoder)
    encoder: "Architecture | None" = None  # an encoder-decoder's encoder stack (its activations are kept too)

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dim(self) -> int:
        return self.head_dim or max(1, self.hidden // self.heads)

    @property
    def width(self) -> int:
        return self.mlp_width or 4 * self.hidden

    @property
    def moe_layer_count(self) -> int:
        if not self.experts:
            return 0
        return self.layers if self.moe_layers is None else self.moe_layers


@dataclass(frozen=True)
class ModelStats:
    """Unique parameter count plus the facts that size activations and the stage-3 working set.

    ``largest_unit`` is the parameter count of the biggest piece stage 3 gathers at once
    (one transformer block, or the embedding if larger); None when unknown.
    ``factored_state_numel`` is Adafactor's factored second moment: rows + cols for each
    matrix, numel for each vector. ``outside_params`` (embeddings, final norm, untied
    head) is what an FSDP/ZeRO-3 root unit gathers; ``largest_tensor`` bounds the
    for-loop optimizer's temporaries and ZeroRedundancyOptimizer's partitions.
    """

    params: int
    largest_unit: int | None = None
    architecture: Architecture | None = None
    factored_state_numel: int = 0
    source: str = "params"
    outside_params: int | None = None     # parameters outside the repeated blocks (embeddings, head)
    block_params: int | None = None       # one repeated block (the largest, for MoE/mixed stacks)
    largest_tensor: int | None = None     # elements of the largest single parameter
    # a module's transformer shape as read from it (module_shape.py): for the time model only,
    # its activations are traced
    timing_shape: Architecture | None = None
    # fields the config omitted, as transformers' config class filled them ("num_key_value_heads=8")
    config_defaults: tuple[str, ...] = ()
    # parts whose activations no model covers (a multimodal config's vision tower, a state-space
    # model): named in the answer as unbounded, never counted as 0
    unmodelled_activations: tuple[str, ...] = ()

    @property
    def shape(self) -> Architecture | None:
        """The architecture the time model prices: the one given, else a module's own."""
        return self.architecture or self.timing_shape


def factored_numel(shape: Sequence[int]) -> int:
    """Elements of Adafactor's second-moment state for one tensor of this shape."""
    if len(shape) < 2:
        return math.prod(shape)
    return shape[0] + math.prod(shape[1:])


def factored_numel_of(shapes: Iterable[Sequence[int]]) -> int:
    return sum(factored_numel(shape) for shape in shapes)


def check_count(name: str, value: object, *, minimum: int = 1, maximum: int = MAX_PLAUSIBLE_PARAMS) -> int:
    """Validate a whole-number input (accepts 7e9 written as a float) and return it as int."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EstimatorInputError(f"{name} must be a number, got {value!r}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise EstimatorInputError(f"{name} must be a whole number, got {value!r}")
    number = int(value)
    if number < minimum:
        raise EstimatorInputError(f"{name} must be at least {minimum}, got {number}")
    if number > maximum:
        raise EstimatorInputError(f"{name} = {number:.3g} is implausibly large (limit {maximum:.0e}); check the exponent")
    return number


def stats_from_count(
    params: int | float,
    *,
    largest_unit: int | float | None = None,
    architecture: Architecture | None = None,
) -> ModelStats:
    """ModelStats for a bare parameter count such as ``7e9``.

    Without ``largest_unit`` but with an architecture, the unit is the larger of one
    GPT block (12h² + 13h: QKV, output, 4h MLP, biases, two LayerNorms) and the
    V×h embedding.
    """
    count = check_count("params", params)
    unit = None if largest_unit is None else check_count("largest layer", largest_unit, maximum=count)
    if unit is None and architecture is not None:
        h = architecture.hidden
        unit = min(count, max(12 * h * h + 13 * h, architecture.vocab * h))
    return ModelStats(params=count, largest_unit=unit, architecture=architecture, source="params")
