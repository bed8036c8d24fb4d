"""shardengine: ZeRO stages 0-3 for PyTorch over torch.distributed.

>>> import torch, shardengine as se
>>> info = se.init_distributed()           # torchrun/SLURM env, else world size 1
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage=1)
>>> loss = model(torch.randn(4, 8)).pow(2).mean()
>>> loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from .errors import CheckpointError, CollectiveError, ConfigError, ShardedAccessError
from .state.checkpoint import load_checkpoint, save_checkpoint
from .state.consolidate import consolidated_optimizer_state_dict, consolidated_state_dict
from .state.interop import deepspeed_training_state, load_dcp_checkpoint, load_training_state, save_dcp_checkpoint
from .distributed.traffic import CommStats
from .distributed.launch import DistInfo, init_distributed, is_main_process, rank, world_size
from .config import ShardConfig
from .policies import Activations, Compression, Hybrid, MixedPrecision, Offload, Stage3
from .memory import MemoryReport
from .flat.meta_init import meta_parameters
from .model import ShardedModel, shard
from .model_reports import StepStats
from .stages.forward_methods import register_forward_method
from .optim.muon_recipe import muon_with_adamw
from .optim.optimizer_list import OptimizerList
from .state.hf.pretrained import LoadReport, load_pretrained, save_pretrained
from .data.proportions import proportional_counts, rebalance_proportions
from .data.sampler import ProportionalSampler

__all__ = ["Activations", "CheckpointError", "CollectiveError", "CommStats", "Compression", "ConfigError", "ShardedAccessError", "DistInfo",
           "Hybrid", "LoadReport", "MemoryReport", "MixedPrecision", "Offload", "OptimizerList", "ProportionalSampler",
           "ShardConfig", "ShardedModel", "Stage3", "StepStats", "consolidated_optimizer_state_dict",
           "consolidated_state_dict", "deepspeed_training_state", "init_distributed", "is_main_process",
           "load_checkpoint", "load_dcp_checkpoint", "load_training_state", "load_pretrained", "meta_parameters", "muon_with_adamw",
           "proportional_counts", "rank",
           "rebalance_proportions", "register_forward_method", "save_checkpoint", "save_dcp_checkpoint", "save_pretrained", "shard", "world_size"]
