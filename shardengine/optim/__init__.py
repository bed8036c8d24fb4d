"""The optimizer over shards.

``rebuild`` (the user's optimizer rebuilt over owned slices),
``sharded_optimizer`` (what ``shard()`` returns, tied to the engine),
``state_dict`` (its state in torch's format, sharded and full),
``whole_tensor`` (Muon, Adafactor: each parameter stepped whole by one owner),
``optimizer_list`` (several optimizers stepped as one) and ``muon_recipe``
(Muon on hidden matrices, AdamW on the rest).

Published here: ``OptimizerList`` and ``muon_with_adamw``, loaded on first use (see [Note: the
public face] in ``shardengine/public_face.py``), so the estimator's import of the pure
``step_groups`` loads nothing else.
"""

from ..public_face import lazy_exports

# name -> the module that defines it
_HOMES = {"OptimizerList": ".optimizer_list", "muon_with_adamw": ".muon_recipe"}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES, __all__)
