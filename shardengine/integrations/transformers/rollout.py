"""TRL's vLLM mode on a sharded policy: ``GRPOTrainer(use_vllm=True)`` gets its weights from the stream.

[Note: TRL's vLLM sync, streamed]
TRL pushes the policy to vLLM by walking ``VLLMGeneration._iter_named_params()`` (colocate mode:
each pair goes to the model's ``load_weights``; server mode: the main process sends the pairs,
announced beforehand by ``_weight_metadata``, over its NCCL group while every process walks the
iterator). For a sharded policy that walk is replaced by ``model.stream_weights``: the weights
under the merged model's names (a PEFT policy's LoRA merged, as TRL merges it), each tied
weight once, no buffers (what vLLM's ``load_weights`` takes), in vLLM's dtype, a bucket at a
time under ``weight_sync_bytes``; in server mode only the main process materializes them (the
other ranks send it their slices), in colocate mode every process feeds its own engine.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from shardengine.rl.stream import bucket_layout


def named_weights(model: Any, dtype: Optional[torch.dtype], bucket_bytes: int, receivers: Any
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``model``'s weights for an inference engine, a bucket at a time
    (every rank iterates; ranks outside ``receivers`` get nothing)."""
    for bucket in model.stream_weights(dtype=dtype, bucket_bytes=bucket_bytes, receivers=receivers,
                                       tied_once=True, buffers=False):
        yield from bucket


def wire_vllm(trainer: Any, model: Any, bucket_bytes: int) -> None:
    """Point TRL's vLLM weight sync at the stream (a no-op for a trainer without vLLM)."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or not getattr(trainer, "use_vllm", False):
        return
    receivers = "all" if generation.mode == "colocate" else [0]
    dtype = _vllm_dtype(generation)
    generation._iter_named_params = lambda: named_weights(model, dtype, bucket_bytes, receivers)
    if generation.mode == "server":
        stream = model.stream_weights(dtype=dtype, bucket_bytes=bucket_bytes, receivers=receivers, tied_once=True,
                                      buffers=False)
        generation._weight_metadata = [(name, str(d).removeprefix("torch."), list(shape))
                                       for plan in stream.plans for name, d, _, shape in bucket_layout(plan)]


def _vllm_dtype(generation: Any) -> Optional[torch.dtype]:
    """The dtype vLLM holds the weights in (colocate: read from the engine), else the training dtype."""
    try:
        return generation.llm.llm_engine.model_config.dtype
    except AttributeError:
        return None
