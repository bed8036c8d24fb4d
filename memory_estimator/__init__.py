"""memory_estimator: will this model train on these accelerators, and how?

Before anything is allocated, it adds up every per-rank term of training memory —
parameters, gradients, optimizer states (incl. fp32 master weights), activations, the
engine's buffers and overheads — for plain DDP, ZeRO stages 1-3 and offload, as
shardengine, PyTorch DDP, FSDP2 or DeepSpeed run them, and recommends the
least-sharded plan that fits.

>>> from memory_estimator import estimate
>>> result = estimate(params=7e9, hidden=4096, layers=32, heads=32, vocab=32000,
...                   world_size=8, micro_batch=1, seq_len=4096, device="A100-80GB")
>>> result.recommended
'zero1'

The same question as a typed request (what the model is, how it trains, on what):

>>> from memory_estimator import EstimateRequest, ModelRequest, TargetRequest, TrainingRequest
>>> request = EstimateRequest(ModelRequest(params=7e9, hidden=4096, layers=32, heads=32, vocab=32000),
...                           TrainingRequest(world_size=8, micro_batch=1, seq_len=4096),
...                           target=TargetRequest(device="A100-80GB"))
>>> estimate(request).recommended
'zero1'

Everything else is in one documented submodule each; the names that were at the top until this
release still resolve there, with a ``DeprecationWarning`` naming the new import path (see
[Note: the public face] in shardengine/public_face.py and docs/architecture.md).
"""
import importlib
import warnings
from typing import Any

from .api import Estimate, estimate
from .errors import EstimatorInputError
from .request import (EngineRequest, EstimateRequest, FineTuningRequest, ModelRequest, TargetRequest,
                      TrainingRequest)
from .engines.shardengine_exact import EngineOptions
from .plan.memory import PlanEstimate
from .plan.fastest import fastest_plan
from .plan.auto_plan import auto_plan
from .plan.timed import TimingRequest, time_estimate

__all__ = [
    "estimate", "Estimate", "PlanEstimate", "EstimatorInputError",
    "EstimateRequest", "ModelRequest", "TrainingRequest", "FineTuningRequest", "EngineRequest", "EngineOptions",
    "TargetRequest", "TimingRequest", "time_estimate", "fastest_plan", "auto_plan",
]

# Names that were at the top until this release -> the module that defines them.
_MOVED = {
    **dict.fromkeys(["CATALOG", "Device", "resolve_device"], "memory_estimator.hardware.devices"),
    **dict.fromkeys(["ENGINES", "DeepSpeedKnobs"], "memory_estimator.engines"),
    **dict.fromkeys(["SUPPORTED_MODEL_TYPES", "stats_from_config"], "memory_estimator.model.hf_config"),
    **dict.fromkeys(["Architecture", "ModelStats"], "memory_estimator.model.stats"),
    **dict.fromkeys(["PLAN_NAMES", "BytesPerParam", "bytes_per_param", "model_state_bytes"],
                    "memory_estimator.terms.model_states"),
    **dict.fromkeys(["PRECISIONS", "precision_policy"], "memory_estimator.terms.precision"),
    "optimizer_name": "memory_estimator.terms.optimizers", "Overheads": "memory_estimator.terms.overheads",
    "TrainingSetup": "memory_estimator.plan.memory", "PlannedRun": "memory_estimator.plan.fastest",
    "TimedEstimate": "memory_estimator.plan.timed", "largest_device_budget": "memory_estimator.plan.device_budget",
    "auto_device": "memory_estimator.plan.auto_plan",
}


def __getattr__(name: str) -> Any:
    """An old top-level name: the same object, from its new home, with a warning naming it."""
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"`memory_estimator.{name}` moved to `{home}.{name}`; import it as `from {home} import {name}` "
                  "(the old name goes in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)
