"""The widths LoRA's adapters read and write, summed over the model (for ``operations.py``)."""
from __future__ import annotations

from ..model.stats import Architecture
from ..terms.adapters import MLP, Adapters, linear_shapes


def adapted_widths(arch: Architecture, adapters: Adapters) -> dict[str, int]:
    """``adapter_inputs`` / ``adapter_outputs``: per token, the input and output elements of
    every adapted linear (A reads the input, B writes the output); an MoE layer's adapted
    experts count once per routed token (top-k), the head once."""
    inputs = outputs = 0
    for moe, count in ((True, arch.moe_layer_count), (False, arch.layers - arch.moe_layer_count)):
        for name, (i, o, _copies) in linear_shapes(arch, moe).items():
            if name in adapters.lora_targets and count:
                routed = arch.experts_per_token if moe and name in MLP else 1
                inputs, outputs = inputs + count * routed * i, outputs + count * routed * o
    if "lm_head" in adapters.lora_targets and arch.lm_head:
        inputs, outputs = inputs + arch.hidden, outputs + arch.vocab
    return {"adapter_inputs": inputs, "adapter_outputs": outputs}
