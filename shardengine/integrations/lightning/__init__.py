"""PyTorch Lightning on shardengine: ``Trainer(strategy=ShardStrategy(stage=3))``.

Needs ``lightning`` (``pip install -e ".[lightning]"``); see docs/integrations.md.
"""

from .checkpoint import consolidate_checkpoint
from .strategy import ShardStrategy

__all__ = ["ShardStrategy", "consolidate_checkpoint"]
