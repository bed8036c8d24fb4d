"""A rollout model beside the trainer (colocated RL: GRPO, PPO, online DPO): its bytes per device.

[Note: what a colocated rollout engine holds]
An inference engine on the trainer's GPU (vLLM or SGLang in TRL's, verl's or OpenRLHF's
colocate mode) holds, per device:

* its **weights**: the policy's parameters in the rollout dtype, split over its tensor-parallel
  ranks (``tensor_parallel``);
* its **KV cache**: 2 (K and V) x layers x KV heads x head dim x bytes per element for every
  token it keeps (``kv_tokens``: vLLM pre-allocates a pool, the number it logs as "GPU KV
  cache size: N tokens"; generating G completions of L tokens for P prompts at once keeps
  about P x G x L), split over the tensor-parallel ranks by KV head;
* its **activations**: a chunked prefill of ``prefill_tokens`` (vLLM's
  ``max_num_batched_tokens``, 8192 by default), each layer's hidden, QKV and MLP widths in the
  rollout dtype, and the sampler's fp32 logits over the vocabulary for the ``decode_batch``
  sequences it decodes at once (``max_num_seqs``, 256 by default);
* during a **weight sync**, one bucket of the stream (``sync_bucket_bytes``; a single tensor
  larger than that, the embedding say, is streamed alone: docs/rl.md), loaded in place.

``sleep``: vLLM's sleep mode during the training step: ``"weights"`` (level 1) moves the weights
to host memory and discards the KV cache, ``"all"`` (level 2) discards both; ``"none"`` keeps
everything resident. Sources: vLLM's engine arguments and its memory profiling
(``gpu_memory_utilization``, ``max_num_batched_tokens``, ``max_num_seqs``); the KV formula is the
standard one (vLLM's ``get_kv_cache_spec``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import EstimatorInputError
from ..model.stats import ModelStats

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
SLEEP_MODES = ("none", "weights", "all")
LOGITS_BYTES = 4  # samplers work on fp32 logits


@dataclass(frozen=True)
class RolloutRequest:
    """The rollout engine on each trainer device (see the Note); ``kv_tokens`` is the one required field."""

    kv_tokens: int
    dtype: str = "bf16"
    kv_dtype: str | None = None          # default: the rollout dtype
    tensor_parallel: int = 1
    decode_batch: int = 256
    prefill_tokens: int = 8192
    sync_bucket_bytes: int = 256 * 2**20
    sleep: str = "none"
    params: int | None = None            # the rollout model's parameters (default: the trained model's)


@dataclass(frozen=True)
class RolloutTerms:
    """Bytes per device of one rollout engine, and of the weight sync into it."""

    weights: int
    kv_cache: int
    activations: int
    sync_bucket: int

    def during_training(self, sleep: str) -> int:
        """What the engine keeps on the device while the trainer steps."""
        return {"none": self.weights + self.kv_cache, "weights": 0, "all": 0}[sleep]


def check_rollout(request: RolloutRequest) -> RolloutRequest:
    """Refuse values that cannot describe a rollout engine."""
    for name in ("kv_tokens", "tensor_parallel", "decode_batch", "prefill_tokens", "sync_bucket_bytes"):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "kv_tokens" else 1):
            raise EstimatorInputError(f"rollout {name} must be a whole number >= "
                                      f"{0 if name == 'kv_tokens' else 1}, got {value!r}")
    for name in ("dtype", "kv_dtype"):
        value = getattr(request, name)
        if value is not None and value not in DTYPE_BYTES:
            raise EstimatorInputError(f"rollout {name} must be one of {sorted(DTYPE_BYTES)}, got {value!r}")
    if request.sleep not in SLEEP_MODES:
        raise EstimatorInputError(f"rollout sleep must be one of {SLEEP_MODES}, got {request.sleep!r}")
    return request


def rollout_terms(stats: ModelStats, request: RolloutRequest) -> RolloutTerms:
    """The rollout engine's bytes per device for a model with these facts."""
    request = check_rollout(request)
    arch = stats.architecture
    if arch is None:
        raise EstimatorInputError("a rollout's KV cache needs the model's shape: give --config, or --params with "
                                  "--hidden, --layers, --heads and --vocab")
    tp, item = request.tensor_parallel, DTYPE_BYTES[request.dtype]
    kv_item = DTYPE_BYTES[request.kv_dtype or request.dtype]
    params = request.params if request.params is not None else stats.params
    kv_per_token = 2 * arch.layers * arch.kv * arch.dim * kv_item
    mlp = (3 if arch.gated_mlp else 2) * (arch.mlp_width or 4 * arch.hidden)
    qkv = (arch.heads + 2 * arch.kv) * arch.dim
    prefill = request.prefill_tokens * (2 * arch.hidden + qkv + mlp) * item
    logits = request.decode_batch * arch.vocab * LOGITS_BYTES
    largest = (stats.largest_tensor or 0) * item
    return RolloutTerms(weights=params * item // tp, kv_cache=request.kv_tokens * kv_per_token // tp,
                        activations=prefill // tp + logits, sync_bucket=max(request.sync_bucket_bytes, largest))
