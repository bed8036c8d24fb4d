"""What a ZeRO stage shards, as data: :class:`StageSpec` and the facts derived from it.

[Note: how a stage differs]
A stage is three booleans -- are optimizer states, gradients, parameters
sharded -- and everything else the shared code needs to know follows from
them (the properties below). The engine never asks which stage it is: it reads
these facts, and it calls the collaborators that stages/recipes.py picks for
the stage (how a bucket's gradient is stored and reduced, where parameters live
between uses, how updated parameters reach the other ranks). Each behaviour is
defined once, in the collaborator that owns it, so a stage is a row of a table,
not a subclass.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..flat.plan import BucketShape


@dataclass(frozen=True)
class StageSpec:
    """What one ZeRO stage shards across the ranks (each implies the one before).

    >>> spec = StageSpec(shards_optimizer=True, shards_grads=True, shards_params=False)
    >>> spec.stage, spec.keeps_full_grads, spec.divides_on_landing
    (2, False, True)
    """

    shards_optimizer: bool   # each rank steps only its owned slice of every bucket (stage >= 1)
    shards_grads: bool       # full gradients exist only while a bucket is reduced (stage >= 2)
    shards_params: bool      # parameters live as slices, gathered around their use (stage 3)

    def __post_init__(self) -> None:
        if (self.shards_params and not self.shards_grads) or (self.shards_grads and not self.shards_optimizer):
            raise ConfigError(f"{self}: sharding parameters needs sharded gradients, and sharding "
                              "gradients needs sharded optimizer states (the ZeRO stages nest)")

    @property
    def stage(self) -> int:
        """0..3: the ZeRO stage these facts describe."""
        return int(self.shards_optimizer) + int(self.shards_grads) + int(self.shards_params)

    @property
    def guards_params(self) -> bool:
        """Parameters get the partial-gradient and sharded-parameter guards (flat/guard.py)."""
        return self.shards_optimizer

    @property
    def steps_whole(self) -> bool:
        """Every rank steps whole buckets (no owned slices)."""
        return not self.shards_optimizer

    @property
    def grads_replicated(self) -> bool:
        """Every rank holds the same reduced gradients (clipping needs no sum over ranks)."""
        return not self.shards_optimizer

    @property
    def keeps_full_grads(self) -> bool:
        """The full gradient buffer persists across micro-steps."""
        return not self.shards_grads

    @property
    def divides_on_landing(self) -> bool:
        """Each reduction is averaged as it lands; else the owned slice keeps the reduced
        sum and the window divides it once, at the step (stage 1)."""
        return self.shards_grads or not self.shards_optimizer

    @property
    def normalizes_each_backward(self) -> bool:
        """DDP's contract: after a synchronizing backward ``p.grad`` is the average."""
        return not self.shards_optimizer

    @property
    def buckets_end_at_units(self) -> bool:
        """Buckets are also cut where a unit ends: the transient full gradient of a whole,
        replicated bucket is bounded by a block (flat/plan.py: [Note: stage 2's buckets end
        at unit boundaries]); stage 3 buckets per unit anyway."""
        return self.shards_grads and not self.shards_params

    @property
    def bucket_shape(self) -> BucketShape:
        """How this stage cuts its buckets (flat/plan.py): per unit at stage 3, ending at unit
        boundaries at stage 2, by size alone at stages 0-1."""
        return BucketShape(per_unit=self.shards_params, cut_at_units=self.buckets_end_at_units)

    @property
    def reduces_every_micro_step(self) -> bool:
        """Gradients are reduced even under ``no_sync()``: skipping would mean holding a full
        unsharded gradient across micro-steps, exactly the memory sharding them saves."""
        return self.shards_grads

    @property
    def forward_communicates(self) -> bool:
        """An eval forward runs collectives too (parameters are gathered per unit)."""
        return self.shards_params
