"""What the step-time model is given and what it gives back (step.py prices them).

:class:`Workload` is the model's shape and what a step computes, :class:`Cluster` the
ranks, links and device rates, :class:`TimedPlan` the sharding plan to price; each
priced collective (or host copy, or drive read) is a :class:`CollectiveUse`, and the
whole step a :class:`StepTime`. Plain frozen records, so step.py stays the pricing
alone and the callers (plan/timed.py, the calibration, the benchmarks) share one shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from shardengine.engine_facts import Compression

from ..errors import EstimatorInputError
from ..hardware.interconnects import Link
from ..hardware.rates import DeviceRates


@dataclass(frozen=True)
class Workload:
    """The model's shape as the engine flattens it, and what one step computes.

    ``buckets``: padded elements of each trainable gradient bucket (stages 0-2);
    ``units``: stage 3's units as (padded parameter elements, padded gradient elements),
    root last; empty means one unit holding everything.
    """

    params: int
    tokens_per_micro_step: int
    buckets: tuple[int, ...] = ()
    units: tuple[tuple[int, int], ...] = ()
    layers: Optional[int] = None
    hidden: Optional[int] = None
    seq_len: Optional[int] = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    checkpointing: str = "none"
    grad_accum: int = 1
    prefetch: int = 1
    reshard_after_forward: bool = True    # stage 3: False gathers each unit once per micro-step, not twice
    grad_tensors: int = 0                 # trainable parameter tensors: flags in the step's agreement
    buffer_groups: tuple[int, ...] = ()   # bytes of the module's buffers, per dtype (broadcast per backward)
    compression: Optional["Compression"] = None
    bucket_shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per bucket, its tensors' shapes (PowerSGD)
    trainable: Optional[int] = None       # frozen base: the parameters with weight gradients (None: all)
    newton_schulz_flops: float = 0.0      # Muon: FLOPs to orthogonalize every matrix once
    outside_params: int = 0               # embeddings, head: outside the checkpointed layers
    compute_dtype: Optional[str] = None   # autocast's dtype under AMP (None: ``precision``)
    quantized_numel: int = 0              # a quantized base's weights, dequantized per matmul (kernel_time.py)
    quantized_bytes: float = 0.0          # their stored bytes per element
    compile: bool = False                 # torch.compile fuses the element-wise kernels
    fused_norm: bool = False              # the norms are fused kernels already
    fused_mlp: bool = False               # the MLP's activation (and gate product) is one kernel (kernel_families.py)
    fused_residual: bool = False          # dropout + residual add + norm in one kernel (flash-attention)
    mlp_width: Optional[int] = None
    gated_mlp: bool = False
    norms_per_layer: int = 2
    norm: str = "layernorm"               # "rmsnorm": written in torch ops (eager: unfused, operations.py)
    dropout: bool = False                 # the layers' dropout is active
    kv_width: Optional[int] = None        # keys' and values' width (GQA: kv heads x head dim; None: hidden)
    vocab: Optional[int] = None           # the loss's logits per token (None: no language-model loss)
    loss: str = "plain"                   # "plain", "chunked", "fused" or "inplace" cross-entropy
    logits_cast: Optional[int] = None     # bytes per logit after Unsloth's cast to the checkpoint's dtype
    lora_rank: Optional[int] = None       # LoRA's adapters (operations.py prices their A and B) ...
    adapter_inputs: int = 0               # ... summed input widths of the adapted linears, all layers
    adapter_outputs: int = 0              # ... and their output widths
    lora_dropout: float = 0.0
    # activation offload: bytes each unit's saved activations cross the host link per micro-step,
    # forward order (down as forward saves them, up again ahead of the unit's backward)
    offloaded_activations: tuple[int, ...] = ()

    @property
    def compute_precision(self) -> str:
        """The dtype the matmuls run in: autocast's under AMP, else the weights'."""
        return self.compute_dtype or self.precision

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def all_buckets(self) -> tuple[int, ...]:
        return self.buckets or (self.params,)

    @property
    def all_units(self) -> tuple[tuple[int, int], ...]:
        return self.units or ((self.params, self.params),)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` ranks, the two link classes and the device's rates."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    device: DeviceRates
    efficiency: Optional[float] = None   # None: the device's default for the model's size
    algorithm: str = "auto"
    model_params: Optional[int] = None   # sizes the default efficiency (efficiency.py) ...
    micro_tokens: Optional[int] = None   # ... with the tokens of one micro-step

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise EstimatorInputError(f"need at least one node and one rank per node, got {self.nodes} x "
                                      f"{self.gpus_per_node}")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise EstimatorInputError(f"compute efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def compute_efficiency(self) -> float:
        if self.efficiency is not None:
            return self.efficiency
        return self.device.efficiency_for(self.model_params, self.micro_tokens)

    def group_link(self, ranks: int) -> str:
        """The link class bounding a group of ``ranks`` consecutive ranks."""
        return "inter" if ranks > self.gpus_per_node else "intra"

    @property
    def across_groups_link(self) -> str:
        """Ranks r, r+k, r+2k, ... (one per group) meet across nodes once there are several."""
        return "inter" if self.nodes > 1 else "intra"

    def link(self, name: str) -> Link:
        return self.inter if name == "inter" else self.intra


@dataclass(frozen=True)
class TimedPlan:
    """A plan to time: stage 0-3, offload, and hybrid sharding's group size (None: all ranks)."""

    name: str
    stage: int
    offload: bool = False
    shard_group_size: Optional[int] = None
    disk: bool = False  # offload to files (the disk tier): the step also reads and writes them
    params_on_host: bool = False  # zero3-offload-params: each gather first copies the shard up
    host_share: float = 1.0  # shardengine's fractional offload: the share of the parameters on the host


@dataclass(frozen=True)
class CollectiveUse:
    """One collective of a plan: its buffers, group, link and when it runs."""

    collective: str               # as the engine names it: all_reduce, reduce_scatter, all_gather
    buffer_bytes: tuple[int, ...]  # full buffer of each call
    ranks: int
    link: str                     # "intra" or "inter"
    phase: str                    # see step.PHASES
    per_step: int                 # occurrences per optimizer step
    ring_bytes: int               # sent per rank per step (the engine's accounting)
    seconds: float                # per step
    last_call_s: float            # the call that can never hide (last bucket / first unit)


@dataclass(frozen=True)
class StepTime:
    plan: str
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    tokens_per_step: int
    collectives: tuple[CollectiveUse, ...] = field(default=(), repr=False)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.exposed_comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def ring_bytes(self, link: Optional[str] = None) -> int:
        return sum(c.ring_bytes for c in self.collectives if link is None or c.link == link)

    def to_json_dict(self) -> dict:
        return {"step_time_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "compute_s": self.compute_s, "optimizer_s": self.optimizer_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s,
                "bytes_per_step": {"intra_node": self.ring_bytes("intra"), "inter_node": self.ring_bytes("inter")}}
