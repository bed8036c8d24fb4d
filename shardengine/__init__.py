"""shardengine: ZeRO stages 0-3 for PyTorch over torch.distributed.

>>> import torch, shardengine as se
>>> info = se.init_distributed()           # torchrun/SLURM env, else world size 1
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage=1)
>>> loss = model(torch.randn(4, 8)).pow(2).mean()
>>> loss.backward(); optimizer.step(); optimizer.zero_grad()

The top level holds what a training script needs; everything else is in one documented
submodule each (see [Note: the public face] in ``shardengine/public_face.py`` and
docs/architecture.md): ``shardengine.distributed`` (rank, world_size, is_main_process, DistInfo,
CommStats), ``shardengine.model`` (ShardedModel, meta_parameters, register_forward_method),
``shardengine.config`` (ShardConfig), ``shardengine.interop`` (DeepSpeed, DCP, consolidation,
LoadReport), ``shardengine.optim`` (OptimizerList, muon_with_adamw), ``shardengine.data``
(ProportionalSampler, proportional_counts, rebalance_proportions), ``shardengine.errors`` (every
error class), ``shardengine.model_reports`` (StepStats) and ``shardengine.memory`` (MemoryReport).
"""

from .errors import CollectiveError, ConfigError
from .distributed.launch import init_distributed
from .policies import Activations, Compression, Hybrid, MixedPrecision, Offload, Stage3
from .memory import MemoryReport
from .model import shard
from .state.checkpoint import load_checkpoint, save_checkpoint
from .state.hf.pretrained import load_pretrained, save_pretrained
from .public_face import lazy_exports

__all__ = ["shard", "init_distributed", "Activations", "Offload", "MixedPrecision", "Stage3", "Hybrid", "Compression",
           "ConfigError", "CollectiveError", "save_checkpoint", "load_checkpoint", "save_pretrained",
           "load_pretrained", "MemoryReport"]

# The documented submodules: listed by dir() beside __all__, imported when first read.
_SUBMODULES = ("config", "data", "distributed", "errors", "interop", "memory", "model", "model_reports", "optim")

# Names that were at the top until this release -> their home; reading one warns (one release).
_MOVED = {**dict.fromkeys(["CommStats", "DistInfo", "is_main_process", "rank", "world_size"], "shardengine.distributed"),
         **dict.fromkeys(["ShardedModel", "meta_parameters", "register_forward_method"], "shardengine.model"),
         "ShardConfig": "shardengine.config", "StepStats": "shardengine.model_reports",
         **dict.fromkeys(["CheckpointError", "ShardedAccessError"], "shardengine.errors"),
         **dict.fromkeys(["OptimizerList", "muon_with_adamw"], "shardengine.optim"),
         **dict.fromkeys(["ProportionalSampler", "proportional_counts", "rebalance_proportions"], "shardengine.data"),
         **dict.fromkeys(["LoadReport", "consolidated_optimizer_state_dict", "consolidated_state_dict",
                          "deepspeed_training_state", "load_dcp_checkpoint", "load_training_state",
                          "save_dcp_checkpoint"], "shardengine.interop")}

__getattr__, __dir__ = lazy_exports(__name__, _MOVED, __all__, moved=True, submodules=_SUBMODULES)
