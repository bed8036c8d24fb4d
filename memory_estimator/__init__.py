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
"""
from .api import Estimate, estimate
from .request import (EngineRequest, EstimateRequest, FineTuningRequest, ModelRequest, TargetRequest,
                      TrainingRequest)
from .hardware.devices import CATALOG, Device, resolve_device
from .engines.shardengine_exact import EngineOptions
from .engines import ENGINES, DeepSpeedKnobs
from .errors import EstimatorInputError
from .model.hf_config import SUPPORTED_MODEL_TYPES, stats_from_config
from .terms.model_states import PLAN_NAMES, BytesPerParam, bytes_per_param, model_state_bytes
from .terms.optimizers import optimizer_name
from .terms.overheads import Overheads
from .plan.memory import PlanEstimate, TrainingSetup
from .terms.precision import PRECISIONS, precision_policy
from .plan.fastest import PlannedRun, fastest_plan
from .plan.device_budget import largest_device_budget
from .plan.auto_plan import auto_device, auto_plan
from .plan.timed import TimedEstimate, TimingRequest, time_estimate
from .model.stats import Architecture, ModelStats

__all__ = [
    "estimate", "Estimate", "EstimateRequest", "ModelRequest", "TrainingRequest", "FineTuningRequest",
    "EngineRequest", "TargetRequest", "PlanEstimate", "Overheads", "TrainingSetup", "ModelStats", "Architecture",
    "Device", "CATALOG", "resolve_device", "EstimatorInputError", "SUPPORTED_MODEL_TYPES",
    "stats_from_config", "PLAN_NAMES", "BytesPerParam", "bytes_per_param", "model_state_bytes",
    "TimingRequest", "TimedEstimate", "time_estimate", "fastest_plan", "PlannedRun",
    "EngineOptions", "optimizer_name", "ENGINES", "DeepSpeedKnobs", "PRECISIONS", "precision_policy",
    "largest_device_budget", "auto_plan", "auto_device",
]
