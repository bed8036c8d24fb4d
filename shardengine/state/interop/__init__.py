"""Checkpoints of other frameworks in and out: DeepSpeed ZeRO folders in, torch DCP (FSDP2 /
torchtitan layout) in and out, all through name-keyed training state (``named_state``)."""

from .dcp import load_dcp_checkpoint, save_dcp_checkpoint
from .deepspeed_zero import deepspeed_training_state
from .named_state import load_training_state

__all__ = ["deepspeed_training_state", "load_dcp_checkpoint", "load_training_state", "save_dcp_checkpoint"]
