"""Reinforcement-learning post-training: the trained weights streamed to a rollout model (docs/rl.md).

``model.stream_weights(dtype, bucket_bytes)`` yields the full weights bucket by bucket under a
hard memory cap (stream.py); a receiver loads them: a module in this process
(:class:`ModuleReceiver`), rollout processes beyond a weight group (:class:`RemoteRollout`, and
:class:`RolloutEndpoint` on their side), vLLM or SGLang (receivers/engines.py);
:class:`WeightSync` runs a sync and, every k-th time, the numerics check (numerics.py).
"""

from .numerics import SyncNumerics, check_numerics, compare_logprobs, token_logprobs
from .receivers.module import ModuleReceiver
from .receivers.remote import Message, RemoteRollout, RolloutEndpoint
from .stream import WeightBucket, WeightStream
from .sync import SyncReport, WeightSync

__all__ = ["Message", "ModuleReceiver", "RemoteRollout", "RolloutEndpoint", "SyncNumerics", "SyncReport",
           "WeightBucket", "WeightStream", "WeightSync", "check_numerics", "compare_logprobs", "token_logprobs"]
