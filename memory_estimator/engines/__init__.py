"""Engine memory models: which plans each training engine runs and what they hold.

``--engine shardengine|ddp|fsdp2|deepspeed``; each module cites where the behaviour
it models is documented or implemented.
"""
from __future__ import annotations

from typing import Any

from ..errors import EstimatorInputError
from .base import EngineContext, EngineMemoryModel, EngineTerms
from .ddp import DistributedDataParallel
from .deepspeed import DeepSpeedKnobs, DeepSpeedZero
from .fsdp2 import FullyShard
from .shardengine import ShardEngine, partial_plans

ENGINES = ("shardengine", "ddp", "fsdp2", "deepspeed")

__all__ = ["ENGINES", "EngineMemoryModel", "EngineContext", "EngineTerms", "DeepSpeedKnobs", "make_engine",
           "ShardEngine", "DistributedDataParallel", "FullyShard", "DeepSpeedZero"]


def make_engine(name: str, *, deepspeed_config: Any = None, reduce_dtype: str | None = None,
                gradient_as_bucket_view: bool = False, offload_params: float | None = None,
                offload_device_budget: int | str | None = None, disk: bool = False) -> EngineMemoryModel:
    """The engine model for ``name`` with its knobs (``offload_params`` a fraction or
    ``offload_device_budget``: shardengine's fractional offload plan besides the others;
    ``disk``: the disk tier's plans too, shardengine's and DeepSpeed's NVMe offload).

    >>> [plan.name for plan in make_engine("fsdp2").plans]
    ['zero2', 'zero3', 'zero3-offload-params']
    >>> [plan.name for plan in make_engine("shardengine", disk=True).plans][-2:]
    ['zero3-offload-disk', 'zero3-offload-params-disk']
    """
    if name not in ENGINES:
        raise EstimatorInputError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    if deepspeed_config is not None and name != "deepspeed":
        raise EstimatorInputError("a DeepSpeed config applies to --engine deepspeed only")
    if reduce_dtype is not None and name != "fsdp2":
        raise EstimatorInputError("a reduce dtype is an FSDP2 knob (--engine fsdp2); shardengine takes it "
                                  "through EngineOptions(reduce_precision=...)")
    if (offload_params is not None or offload_device_budget is not None) and name != "shardengine":
        raise EstimatorInputError("a fraction or device budget of offloaded parameters is a shardengine plan "
                                  "(--engine shardengine); the others offload all parameters or none")
    if disk and name not in ("shardengine", "deepspeed"):
        raise EstimatorInputError(f"the disk tier's plans are shardengine's (Offload(optimizer=\"disk\") / "
                                  f"Offload(params=\"disk\")) and DeepSpeed's (ZeRO-Infinity, offload device "
                                  f"\"nvme\"); --engine {name} has none: drop --offload disk")
    if name == "ddp":
        return DistributedDataParallel(gradient_as_bucket_view)
    if name == "fsdp2":
        if reduce_dtype not in (None, "fp32", "bf16", "fp16"):
            raise EstimatorInputError(f"unknown reduce dtype {reduce_dtype!r}; choose from fp32, bf16, fp16")
        return FullyShard(reduce_dtype)
    if name == "deepspeed":
        knobs = DeepSpeedKnobs() if deepspeed_config is None else DeepSpeedKnobs.from_config(deepspeed_config)
        return DeepSpeedZero(knobs, disk=disk)
    return ShardEngine(disk=disk, partial=partial_plans(offload_params, offload_device_budget))
