"""Data for uneven ranks: ``proportions`` (shares: check, split, rebalance by speed; pure) and
``sampler`` (``ProportionalSampler``).

Its public names are loaded on first use (see [Note: the public face] in
``shardengine/public_face.py``), so the estimator's import of the pure ``proportions`` loads no
sampler and no process-group code.

>>> from shardengine.data import proportional_counts, rebalance_proportions
>>> proportional_counts(10, [0.6, 0.2, 0.2])
[6, 2, 2]
"""

from ..public_face import lazy_exports

# name -> the module that defines it
_HOMES = {"ProportionalSampler": ".sampler", "proportional_counts": ".proportions",
          "rebalance_proportions": ".proportions"}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES, __all__)
