"""PyTorch Lightning on shardengine: ``Trainer(strategy=ShardStrategy(stage=3))``, and Lightning
Fabric: ``Fabric(strategy=ShardFabricStrategy(stage=3))``.

Needs ``lightning`` (``pip install -e ".[lightning]"``); see docs/integrations.md.
"""

from .checkpoint import consolidate_checkpoint
from .fabric import ShardFabricStrategy
from .strategy import ShardStrategy

__all__ = ["ShardFabricStrategy", "ShardStrategy", "consolidate_checkpoint"]
