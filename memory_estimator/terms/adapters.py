"""Fine-tuning a frozen base: LoRA adapters, trainable-parameter counts, quantized bases.

A LoRA adapter on a linear ``in -> out`` adds ``A`` (r x in) and ``B`` (out x r): r·(in +
out) trainable parameters (Hu et al. 2021; PEFT's ``lora_A.default`` / ``lora_B.default``).
The estimator splits Ψ into the *trainable* parameters (the adapters, or
``trainable_params``) and the *frozen* base:

- the frozen base costs its weights only, in ``base_dtype`` (no gradient, no optimizer
  state, no fp32 master), sharded like parameters at stage 3;
- the trainable parameters cost their full training state, as any engine holds it;
- activations still flow through the frozen layers (``activations.py`` says which
  inputs a frozen torch linear no longer keeps, and what the adapters add).

Quantized bases (bitsandbytes, as QLoRA and HF ``BitsAndBytesConfig`` load them): the
linear layers of the blocks are quantized, the embeddings, norms and the LM head stay in
16 bits (``llm_int8_skip_modules`` defaults to the head). NF4 with double quantization
stores 4 bits plus an 8-bit absmax per 64 values whose fp32 constants are themselves
quantized per 256 blocks: 4 + 8/64 + 32/(64·256) ≈ 4.127 bits per parameter (Dettmers et
al. 2023, "QLoRA", section 3). LLM.int8 stores 1 byte plus an fp32 scale per row. Each
quantized linear is dequantized to the compute dtype for its matmul, one at a time: a
temporary the size of the largest quantized matrix (``dequantized_weight``).

>>> from memory_estimator.model.stats import Architecture
>>> arch = Architecture(layers=32, hidden=4096, heads=32, vocab=32000, mlp_width=11008, gated_mlp=True)
>>> Adapters(lora_rank=8).trainable(arch)          # q, k, v, o, gate, up, down
19988480
>>> Adapters(lora_rank=8, lora_targets=("q_proj", "v_proj")).trainable(arch)
4194304
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import EstimatorInputError
from ..model.stats import Architecture, ModelStats, check_count

# Bytes per stored element of a frozen base (NF4: 4.127 bits with double quantization).
# "nf4-nodq": NF4 without double quantization, an fp32 absmax per 64 values (4.5 bits).
BASE_DTYPES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "nf4": 4.127 / 8, "nf4-nodq": 4.5 / 8}
QUANTIZED = ("int8", "nf4", "nf4-nodq")
# Whose quantized linear runs the base: bitsandbytes (PEFT/HF QLoRA) or torchao's
# ``linear_nf4`` (torchtune's QLoRA, ``FrozenNF4Linear``).
QUANTIZERS = ("bitsandbytes", "torchao")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP + ("lm_head",)
# Names recipes use for the same projections (GPT-2/NeoX/litgpt style) and the groups.
_ALIASES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "dense": "o_proj", "out_proj": "o_proj",
            "output_proj": "o_proj",
            "fc1": "up_proj", "fc2": "down_proj", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
            "c_fc": "up_proj", "c_proj": "down_proj"}
_GROUPS = {"all-linear": ATTENTION + MLP, "attention": ATTENTION, "mlp": MLP}


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """Module names (``q_proj,v_proj``), groups (``attention``, ``mlp``, ``all-linear``) or aliases.

    >>> parse_targets("attention,down_proj")
    ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'down_proj')
    """
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else [str(t) for t in targets]
    out: list[str] = []
    for name in names:
        if not name:
            continue
        expanded = _GROUPS.get(name) or (_ALIASES.get(name, name),)
        for target in expanded:
            if target not in TARGETS:
                raise EstimatorInputError(
                    f"unknown LoRA target {name!r}; choose from {', '.join(TARGETS)}, the groups "
                    f"{', '.join(_GROUPS)} or the aliases {', '.join(sorted(_ALIASES))}")
            if target not in out:
                out.append(target)
    if not out:
        raise EstimatorInputError("LoRA targets are empty; name at least one module, e.g. q_proj,v_proj")
    return tuple(out)


def linear_shapes(arch: Architecture, moe: bool = False) -> dict[str, tuple[int, int, int]]:
    """``target -> (in, out, copies per layer)`` of one layer (an MoE layer's experts are copies)."""
    h, d, f = arch.hidden, arch.dim, arch.width
    shapes = {"q_proj": (h, arch.heads * d, 1), "k_proj": (h, arch.kv * d, 1), "v_proj": (h, arch.kv * d, 1),
              "o_proj": (arch.heads * d, h, 1), "up_proj": (h, f, 1), "down_proj": (f, h, 1)}
    if arch.gated_mlp:
        shapes["gate_proj"] = (h, f, 1)
    if moe:
        shapes = {name: (i, o, arch.experts if name in MLP else 1) for name, (i, o, _) in shapes.items()}
    return shapes


@dataclass(frozen=True)
class Adapters:
    """What is trained on a frozen base, and how the base is stored.

    ``lora_rank`` with ``lora_targets`` (default every attention and MLP projection), or
    ``trainable_params`` directly; ``base_dtype`` None stores the base in the compute
    dtype. ``lora_dropout`` > 0 makes each adapter keep a dropped copy of its input.
    """

    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ATTENTION + MLP
    trainable_params: int | None = None
    base_dtype: str | None = None
    lora_dropout: float = 0.0
    quantizer: str = "bitsandbytes"

    def __post_init__(self) -> None:
        if self.quantizer not in QUANTIZERS:
            raise EstimatorInputError(f"unknown quantizer {self.quantizer!r}; choose from {', '.join(QUANTIZERS)}")
        if self.lora_rank is not None:
            check_count("LoRA rank", self.lora_rank, maximum=1 << 20)
        if self.trainable_params is not None:
            check_count("trainable params", self.trainable_params, minimum=0)
        if self.lora_rank is not None and self.trainable_params is not None:
            raise EstimatorInputError("give --lora-rank or --trainable-params, not both")
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise EstimatorInputError(f"unknown base dtype {self.base_dtype!r}; choose from {', '.join(BASE_DTYPES)}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise EstimatorInputError(f"LoRA dropout must be in [0, 1), got {self.lora_dropout!r}")

    @property
    def frozen_base(self) -> bool:
        return self.lora_rank is not None or self.trainable_params is not None

    @property
    def quantized(self) -> bool:
        return self.base_dtype in QUANTIZED

    def trainable(self, arch: Architecture | None) -> int:
        """Trainable parameters: ``trainable_params``, else the LoRA adapters' count."""
        if self.trainable_params is not None:
            return self.trainable_params
        if self.lora_rank is None:
            raise EstimatorInputError("no adapters: give lora_rank or trainable_params")
        if arch is None:
            raise EstimatorInputError("--lora-rank needs the model's shapes (a config, or --hidden/--layers/--heads/"
                                      "--vocab); else give --trainable-params")
        total = 0
        for moe, count in ((True, arch.moe_layer_count), (False, arch.layers - arch.moe_layer_count)):
            shapes = linear_shapes(arch, moe)
            total += count * sum(self.lora_rank * (i + o) * n for name, (i, o, n) in shapes.items()
                                 if name in self.lora_targets)
        if "lm_head" in self.lora_targets and arch.lm_head:
            total += self.lora_rank * (arch.hidden + arch.vocab)
        return total

    def activation_bytes_per_token(self, arch: Architecture, c: int, moe: bool) -> int:
        """What one layer's adapters add per token: A's output (for B's gradient), and with
        dropout the dropped input copy (for A's gradient) and its 1-byte mask."""
        if self.lora_rank is None:
            return 0
        extra = 0
        for name, (i, _o, n) in linear_shapes(arch, moe).items():
            if name not in self.lora_targets:
                continue
            routed = arch.experts_per_token if moe and name in MLP else 1
            per_copy = c * self.lora_rank + ((c + 1) * i if self.lora_dropout else 0)
            extra += routed * per_copy
        return extra

    def frozen_inputs_kept(self) -> frozenset[str]:
        """Which frozen projections' inputs the layer keeps anyway (see ``activations.py``).

        torch's linear saves its input only to compute the weight's gradient; a frozen
        weight's input is dropped unless an adapter on it needs it. bitsandbytes' 4-bit
        and 8-bit matmuls save their input whatever requires grad, so a quantized base
        keeps all of them; so does an unknown split (``trainable_params`` only). torchao's
        ``LinearNF4`` (torchtune) saves only the NF4 weight (``ctx.nf4_weight``): its
        backward computes the input's gradient alone, so it keeps what a frozen torch
        linear keeps.
        """
        if (self.quantized and self.quantizer == "bitsandbytes") or self.lora_rank is None:
            return frozenset(TARGETS)
        return frozenset(self.lora_targets)


def frozen_numel(stats: ModelStats, adapters: Adapters, trainable: int) -> int:
    """The frozen base's parameters. LoRA adds its adapters beside the base's weights (PEFT's
    wrapped model holds every parameter of the base plus ``lora_A``/``lora_B``), so its base is
    the whole model; ``trainable_params`` are part of the model.

    >>> from memory_estimator.model.stats import ModelStats
    >>> stats = ModelStats(params=1000)
    >>> frozen_numel(stats, Adapters(lora_rank=8), 40), frozen_numel(stats, Adapters(trainable_params=40), 40)
    (1000, 960)
    """
    if adapters.lora_rank is not None:
        return stats.params
    frozen = stats.params - trainable
    if frozen < 0:
        raise EstimatorInputError(f"{trainable:,} trainable parameters exceed the model's {stats.params:,}; "
                                  "adapters are added to the base, so count the base only in --params "
                                  "or use --lora-rank")
    return frozen


def frozen_storage_bytes(stats: ModelStats, adapters: Adapters, frozen: int, compute_bytes: int) -> int:
    """Bytes of the frozen base: quantized blocks' linears at ``base_dtype``, the rest 16-bit."""
    dtype_bytes = BASE_DTYPES[adapters.base_dtype] if adapters.base_dtype else float(compute_bytes)
    if not adapters.quantized:
        return math.ceil(frozen * dtype_bytes)
    unquantized = min(frozen, stats.outside_params or 0) + _norm_params(stats)
    unquantized = min(unquantized, frozen)
    return math.ceil((frozen - unquantized) * dtype_bytes + unquantized * 2)


# bitsandbytes' 4-bit weights: two codes a byte in the packed (sharded) tensor; the rest of
# BASE_DTYPES' figure is the quantization state (absmax per 64-block, nested or not).
_PACKED_BYTES = {"nf4": 0.5, "nf4-nodq": 0.5}


def quant_state_bytes(stats: ModelStats, adapters: Adapters, frozen: int) -> int:
    """Bytes of bitsandbytes' quantization state: whole on every rank's device whatever the plan.

    [Note: bitsandbytes' quantization state is not a parameter]
    ``Params4bit`` keeps its absmax (and nested absmax, code) in a ``QuantState`` attribute, and
    ``Linear4bit`` a reference on the module for FSDP: only the packed weight is a parameter, so
    FSDP1/FSDP2 and DeepSpeed ZeRO-3 shard and offload the packed codes (``bnb_4bit_quant_storage``)
    and every rank keeps the whole state on its device. torchao's ``NF4Tensor`` (torchtune) holds
    its scalers inside the parameter, so they shard with it."""
    if not adapters.quantized:
        return 0
    unquantized = min(frozen, min(frozen, stats.outside_params or 0) + _norm_params(stats))
    return math.ceil((frozen - unquantized) * (BASE_DTYPES[adapters.base_dtype] - packed_bytes_per_element(adapters)))


def packed_bytes_per_element(adapters: Adapters) -> float:
    """What one quantized weight element weighs in the parameter that engines shard and gather:
    bitsandbytes' packed 4-bit codes, else the whole storage (torchao's NF4 tensor, int8).

    >>> packed_bytes_per_element(Adapters(lora_rank=8, base_dtype="nf4"))
    0.5
    """
    if adapters.quantizer == "bitsandbytes" and adapters.base_dtype in _PACKED_BYTES:
        return _PACKED_BYTES[adapters.base_dtype]
    return BASE_DTYPES[adapters.base_dtype]


def _norm_params(stats: ModelStats) -> int:
    arch = stats.architecture
    return 0 if arch is None else arch.layers * arch.norms_per_layer * arch.hidden


def dequantized_weight_bytes(stats: ModelStats, adapters: Adapters, compute_bytes: int) -> int:
    """The largest quantized matrix dequantized for its matmul (0 for a 16-bit base)."""
    if not adapters.quantized:
        return 0
    arch = stats.architecture
    if arch is not None:
        largest = max(i * o for moe in (True, False) for i, o, _ in linear_shapes(arch, moe).values())
    else:
        largest = stats.largest_tensor or 0
    return compute_bytes * largest


def describe(adapters: Adapters, trainable: int, frozen: int) -> str:
    what = (f"LoRA rank {adapters.lora_rank} on {','.join(adapters.lora_targets)}" if adapters.lora_rank
            else "given trainable parameters")
    base = adapters.base_dtype or "the compute dtype"
    return (f"{what}: {trainable:,} trainable parameters (full training state), frozen base of {frozen:,} "
            f"in {base} (weights only)")


def check_targets(targets: Sequence[str] | str | None) -> tuple[str, ...]:
    return ATTENTION + MLP if targets is None else parse_targets(targets)
