"""Every exception shardengine raises, in one place.

Each names a kind of failure a user can catch; the message says what went
wrong and what to do. Kept free of any other shardengine import, so every
module can import from here without a cycle (``config`` and the mixed
precision code used to import each other for ``ConfigError``).

>>> from shardengine.errors import ConfigError
>>> issubclass(ConfigError, ValueError)
True
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CollectiveError", "ConfigError", "GradientProducedTwice", "LossScaleCollapsed",
           "ShardedAccessError", "StateDictMismatch"]


class ConfigError(ValueError):
    """An option of ``shard()`` is unknown or out of range."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message says which and why it may have."""


class ShardedAccessError(RuntimeError):
    """A full parameter value or gradient was read while this rank holds only a slice."""


class LossScaleCollapsed(FloatingPointError):
    """fp16 gradients overflow even at the minimum loss scale."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and the problem."""


class StateDictMismatch(RuntimeError):
    """A state dict's keys or shapes differ from the model's; nothing was written."""


class GradientProducedTwice(RuntimeError):
    """A parameter got a second gradient in one backward after its bucket was reduced."""
