"""Lightning's ``precision=`` flag under ShardStrategy: the engine computes in ``param_dtype``.

[Note: mixed precision without autocast]
Lightning's ``"bf16-mixed"`` plugin runs the step under ``torch.autocast`` and
keeps fp32 weights; the engine's ``param_dtype="bf16"`` instead casts the
compute copy of the weights to bf16 and keeps fp32 masters and optimizer
state, which is what ZeRO's memory figures assume. The flag is therefore
mapped to ``param_dtype`` and the plugin becomes a plain one, so nothing
autocasts or scales a second time. ``"16-mixed"`` maps to ``param_dtype="fp16"``
(the engine's dynamic loss scale replaces Lightning's GradScaler). Other
precisions ("bf16-true", "64-true", quantization plugins) are refused.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

PARAM_DTYPE_OF_PRECISION = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


def param_dtype_for(plugin: Precision, requested: Optional[str]) -> Optional[str]:
    """The ``param_dtype`` the engine uses for Lightning's precision ``plugin``."""
    precision = str(getattr(plugin, "precision", "32-true"))
    if type(plugin) not in (Precision, ShardPrecision) and not _is_plain_mixed(plugin) \
            or precision not in PARAM_DTYPE_OF_PRECISION:
        raise MisconfigurationException(
            f"ShardStrategy does not support precision={precision!r} ({type(plugin).__name__}); use "
            "precision='32-true', 'bf16-mixed' or '16-mixed' (mapped to the engine's param_dtype, with "
            "fp32 master weights), or ShardStrategy(param_dtype='bf16')")
    implied = PARAM_DTYPE_OF_PRECISION[precision]
    if implied is not None and requested is not None and _dtype_name(requested) != implied:
        raise MisconfigurationException(
            f"Trainer(precision={precision!r}) asks for {implied} compute but ShardStrategy was given "
            f"param_dtype={requested!r}; set one of them")
    return requested if implied is None else implied


def _is_plain_mixed(plugin: Precision) -> bool:
    from lightning.pytorch.plugins.precision import MixedPrecision
    return type(plugin) is MixedPrecision


def _dtype_name(value: Any) -> str:
    text = str(value).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(text, text)


class ShardPrecision(Precision):
    """No autocast, no GradScaler (the engine does both); clipping by the engine's global norm."""

    def __init__(self, precision: str, strategy: Any):
        super().__init__()
        self.precision = precision  # type: ignore[assignment]  # Lightning reads it for logging
        self._strategy = strategy

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        model = self._strategy.sharded_model
        if model is None:
            raise MisconfigurationException("gradient clipping before ShardStrategy wrapped the model")
        model.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        raise MisconfigurationException(
            "gradient_clip_algorithm='value' is not supported by ShardStrategy: the reduced gradients "
            "are sharded across ranks (stage >= 1) and are not param.grad tensors. Use "
            "gradient_clip_algorithm='norm' (the global norm over the whole model).")
