"""ShardTrainer's files: an ordinary Hugging Face folder, plus the engine's shards for resuming.

* ``save_model`` / ``save_pretrained``: a folder ``from_pretrained`` loads:
  ``se.save_pretrained`` for a whole model (sharded safetensors, index,
  config), the adapter only for a PEFT model (``adapter_model.safetensors``
  and ``adapter_config.json``, as PEFT writes them).
* a checkpoint (``checkpoint-<step>/``) holds that folder, the scheduler, the
  trainer state and RNG files as ``Trainer`` writes them, and
  ``shardengine/``: the engine's sharded checkpoint (fp32 masters, optimizer
  state, RNG), which ``resume_from_checkpoint`` restores exactly, at any
  world size and stage.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import shardengine as se
from shardengine.model import ShardedModel

ENGINE_DIR = "shardengine"      # the engine's checkpoint inside a Trainer checkpoint folder
SCHEDULER_NAME = "scheduler.pt"   # transformers' name for the scheduler's state
TRAINING_ARGS_NAME = "training_args.bin"


def engine_checkpoint(folder: str) -> str:
    return os.path.join(folder, ENGINE_DIR)


def has_engine_checkpoint(folder: str) -> bool:
    return os.path.isdir(engine_checkpoint(folder))


def save_whole_model(model: ShardedModel, folder: str) -> None:
    """Collective: every rank writes its share of the safetensors files."""
    se.save_pretrained(model, folder)


def save_extras(trainer: Any, folder: str) -> None:
    """What ``Trainer._save`` writes beside the weights (rank 0): tokenizer/processor, arguments."""
    processing = trainer.processing_class
    if processing is None:
        processing = getattr(trainer.data_collator, "tokenizer", None)
    if processing is not None:
        processing.save_pretrained(folder)
    torch.save(trainer.args, os.path.join(folder, TRAINING_ARGS_NAME))


def save_scheduler(scheduler: Any, folder: str) -> None:
    if scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(folder, SCHEDULER_NAME))


def load_scheduler(scheduler: Any, folder: str) -> None:
    path = os.path.join(folder, SCHEDULER_NAME)
    if scheduler is not None and os.path.isfile(path):
        scheduler.load_state_dict(torch.load(path, weights_only=True))
