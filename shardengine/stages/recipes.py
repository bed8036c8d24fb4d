"""Which code each ZeRO stage runs: ``STAGES``, one row per stage.

``shard(stage=s)`` builds ``StageEngine(STAGES[s], ...)`` (stages/engine.py); the
row names the stage's facts (:class:`~shardengine.stages.spec.StageSpec`) and the
three collaborators that differ between stages. Everything else (forward and
backward hooks, the gradient window, the optimizer step, failures, reports) is
the same code at every stage, reading the spec's facts.

=====  ==========================  ======================  ===================
stage  gradients (gradients.py)    layout                  publication
=====  ==========================  ======================  ===================
0      ``KeptAllReduce``           ``WholeBuckets``        ``KeepReplicas``
1      ``KeptReduceScatter``       ``WholeBuckets``        ``GatherAfterStep``
2      ``TransientReduceScatter``  ``WholeBuckets``        ``GatherAfterStep``
3      ``TransientReduceScatter``  ``UnitScheduler``       ``GatherOnUse``
=====  ==========================  ======================  ===================

>>> STAGES[2].spec.stage, STAGES[2].gradients.__name__, STAGES[3].layout.__name__
(2, 'TransientReduceScatter', 'UnitScheduler')
"""

from __future__ import annotations

from dataclasses import dataclass

from .buckets import WholeBuckets
from .gradients import KeptAllReduce, KeptReduceScatter, TransientReduceScatter
from .publication import GatherAfterStep, GatherOnUse, KeepReplicas
from .spec import StageSpec
from .unit_scheduler import UnitScheduler


@dataclass(frozen=True)
class StageRecipe:
    """A stage: what it shards, and the collaborators that do what differs."""

    spec: StageSpec
    gradients: type     # how a bucket's gradient is stored and reduced (its ``wire``)
    layout: type        # where parameters live between uses, and what backward reduces (its ``wire``)
    publication: type   # how updated parameters reach every rank after the step (its ``wire``)


STAGES: dict[int, StageRecipe] = {
    0: StageRecipe(StageSpec(shards_optimizer=False, shards_grads=False, shards_params=False),
                   KeptAllReduce, WholeBuckets, KeepReplicas),
    1: StageRecipe(StageSpec(shards_optimizer=True, shards_grads=False, shards_params=False),
                   KeptReduceScatter, WholeBuckets, GatherAfterStep),
    2: StageRecipe(StageSpec(shards_optimizer=True, shards_grads=True, shards_params=False),
                   TransientReduceScatter, WholeBuckets, GatherAfterStep),
    3: StageRecipe(StageSpec(shards_optimizer=True, shards_grads=True, shards_params=True),
                   TransientReduceScatter, UnitScheduler, GatherOnUse),
}
