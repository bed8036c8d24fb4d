"""Hugging Face ``Trainer`` on shardengine: ``ShardTrainer(model, args, shard_config={"stage": 3})``.

Needs ``transformers`` (``pip install -e ".[hf]"``); see docs/integrations.md.
"""

from .trainer import ShardTrainer, ShardTrainerMixin, shard_trainer_class

__all__ = ["ShardTrainer", "ShardTrainerMixin", "shard_trainer_class"]
