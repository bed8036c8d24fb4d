"""The hand-written Hugging Face families by ``model_type``, and a family's shapes as ModelStats.

Its own module so that reading a module's shape (module_shape.py) can use a config's family
without the transformers fallback of hf_config.py (which builds a module, and so would import
module_shape.py back).
"""
from __future__ import annotations

from .stats import ModelStats
from .hf_families import FamilyFn, Layout, gemma, gemma2, llama, mistral, mixtral, olmo, olmo2, phi3, qwen2, qwen3
from .hf_families_classic import bert, bloom, falcon, gpt2, gpt_neox, opt, phi, starcoder2
from .hf_families_moe import deepseek, qwen2_moe, qwen3_moe

_FAMILIES: dict[str, FamilyFn] = {
    "llama": llama, "mistral": mistral, "mixtral": mixtral, "qwen2": qwen2, "qwen3": qwen3,
    "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "gemma": gemma, "gemma2": gemma2, "phi": phi,
    "phi3": phi3, "gpt2": gpt2, "gpt_neox": gpt_neox, "falcon": falcon, "opt": opt, "bloom": bloom,
    "starcoder2": starcoder2, "olmo": olmo, "olmo2": olmo2, "deepseek_v2": deepseek, "deepseek_v3": deepseek,
    "bert": bert,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


def stats_from_layout(layout: Layout, source: str) -> ModelStats:
    """ModelStats from a family's shapes: totals, the largest unit and tensor, the root."""
    blocks = [(tally, count) for tally, count in layout.blocks if count]
    params = sum(tally.numel * count for tally, count in blocks) + layout.outside.numel
    largest_block = max((tally.numel for tally, _ in blocks), default=0)
    return ModelStats(
        params=params,
        largest_unit=max(largest_block, layout.largest_outside_unit),
        architecture=layout.architecture,
        factored_state_numel=sum(t.factored_numel * n for t, n in blocks) + layout.outside.factored_numel,
        source=source,
        outside_params=layout.outside.numel,
        block_params=largest_block,
        largest_tensor=max([t.largest_tensor for t, _ in blocks] + [layout.outside.largest_tensor]),
    )
