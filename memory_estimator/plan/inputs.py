"""What every plan of one answer is priced from (``MemoryInputs``)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..engines import EngineMemoryModel, ShardEngine
from ..engines.shardengine_exact import ExactShardEngineModel
from ..hardware.devices import Device
from ..model.stats import ModelStats
from ..terms.overheads import Overheads
from .capacity import Capacity
from .setup import TrainingSetup

if TYPE_CHECKING:
    from ..allocator.reserved import ShapeCache
    from ..model.facts import ActivationModel


@dataclass(frozen=True)
class MemoryInputs:
    """Everything a plan's per-rank bytes depend on except the plan: the model's facts and its
    activation model, the training setup, the device, the overheads and the engine's memory model.

    ``exact`` is shardengine's exact accounting of a planned module (it applies at the world
    size it was planned for only). Searches vary the setup with :meth:`with_setup`.
    """

    stats: ModelStats
    setup: TrainingSetup
    device: Device
    model: "ActivationModel"           # activations(micro_batch, setup) and logits(micro_batch, setup)
    overheads: Overheads
    engine: EngineMemoryModel = field(default_factory=ShardEngine)
    exact: ExactShardEngineModel | None = None
    capacity: Capacity = field(default_factory=Capacity)  # the node's host RAM and disk (capacity.py)
    shape_cache: "ShapeCache | None" = None   # varying lengths: the replayed allocator's excess (allocator/)
    cast_shape_cache: "ShapeCache | None" = None  # ... replayed with an unstated logits cast (the range's high)

    def with_setup(self, setup: TrainingSetup) -> "MemoryInputs":
        return replace(self, setup=setup)

    def analytic(self) -> "MemoryInputs":
        """The same run priced by shardengine's formulas alone (no engine's knobs, no exact layout)."""
        return replace(self, engine=ShardEngine(), exact=None)
