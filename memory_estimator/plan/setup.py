"""How the model is trained: the setup every plan of one answer shares (``TrainingSetup``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..terms.adapters import Adapters
from ..terms.kernels import Kernels
from ..terms.precision import precision_policy
from ..byte_units import MiB

if TYPE_CHECKING:
    from ..allocator.lengths import LengthDistribution


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained; everything that changes bytes but is not the model."""

    world_size: int = 1
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_len: int = 2048
    checkpointing: str = "none"
    fused_attention: bool = True
    prefetch_depth: int = 1            # stage 3: units gathered ahead of the running one
    reshard_after_forward: bool = True  # shardengine stage 3: False keeps every unit gathered until its backward
    bucket_bytes: int = 25 * MiB       # gradient reduce / parameter gather bucket
    safety_margin: float = 0.10        # fraction of device memory kept free
    shard_numel_per_rank: int | None = None  # exact engine shard size; default ceil(Ψ/N)
    amp: str | None = None             # torch autocast dtype over fp32 weights
    optimizer_impl: str = "foreach"    # "foreach", "fused" or "plain"
    module_loading: str = "lazy"       # CUDA module loading: sizes the context
    zero_grad_to_none: bool = True     # zero_grad() frees gradients (torch >= 2.0) instead of zeroing them
    # Fine-tuning and memory-saving kernels (finetune.py, kernels.py, finetune_terms.py).
    adapters: Adapters | None = None   # LoRA / trainable subset on a frozen (maybe quantized) base
    loss: str = "plain"                # "plain", "chunked" or "fused" cross-entropy
    fused_norm: bool = False
    compile: bool = False
    mlp_kernel: str = "eager"          # "fused" / "fused-recompute" (kernel_families.py)
    fused_residual: bool = False       # dropout + residual add + norm in one kernel (time only)
    kernel_families: tuple[str, ...] = ()
    logits_cast: bool | None = False   # Unsloth's cast of the logits to the checkpoint's torch_dtype: True priced,
                                       # None possible (the range's high; kernels.py), False none
    grad_accum: int = 1                # micro-steps per optimizer step: gradients held across them
    optimizer_in_backward: bool = False  # each parameter steps (and frees its gradient) in backward
    activation_offload: bool = False   # saved activations offloaded to host RAM (torchtune)
    # What the caching allocator holds (allocator/): the batches' lengths when they vary, its mode.
    lengths: "LengthDistribution | None" = None   # None: every batch at seq_len
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    loss_upcast: bool | None = None    # plain loss on fp32 copies of 16-bit logits; None: not stated
    # set per plan from the engine (plan_estimate): every linear keeps its input (DeepSpeed's zero.Init linear)
    linear_inputs_kept: bool = False

    @property
    def policy(self):
        return precision_policy(self.precision, self.amp)

    @property
    def kernels(self) -> Kernels:
        return Kernels(fused_norm=self.fused_norm, compiled=self.compile, adapters=self.adapters, mlp=self.mlp_kernel,
                       linear_inputs_kept=self.linear_inputs_kept)

    def logits_cast_bytes(self, architecture) -> int | None:
        """Bytes per logit after a priced cast to the checkpoint's dtype (Unsloth's; ``kernels.py``), None without one."""
        return architecture.checkpoint_bytes if self.logits_cast else None

    def logits_cast_unstated(self, architecture) -> bool:
        """Whether Unsloth's cast may widen the in-place loss's logits without being priced at the point:
        the answer's range prices it at its high end (``[Note: logits cast to the checkpoint's dtype]``)."""
        wider = architecture is not None and (architecture.checkpoint_bytes or 0) > self.policy.activation_bytes
        return self.logits_cast is None and self.loss == "inplace" and wider
