"""``WeightSync``: push the trainer's weights to a rollout model, and check their numerics every k-th time.

A receiver says which trainer ranks materialize the weights and how a bucket is loaded:
:class:`~shardengine.rl.receivers.module.ModuleReceiver` (a module in this process, on
every rank), :class:`~shardengine.rl.receivers.remote.RemoteRollout` (rollout processes
beyond a weight group, fed by one trainer rank), the vLLM and SGLang receivers
(receivers/engines.py). :meth:`WeightSync.sync` is collective over the trainer's ranks:
it streams the weights into the receiver under the cap and, at every ``check_every``-th
sync, compares the trainer's and the rollout's log-probs on the probe batch
(numerics.py).

>>> import torch, shardengine as se
>>> from shardengine.rl import ModuleReceiver, WeightSync
>>> net = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
>>> model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
>>> rollout = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)).to(torch.bfloat16)
>>> sync = WeightSync(model, ModuleReceiver(rollout), dtype="bf16", bucket_bytes=1 << 20,
...                   check_every=1, probe=torch.tensor([[1, 2, 3, 4]]))
>>> report = sync.sync()
>>> report.bytes, report.numerics.explained_by_dtype
(144, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch

from ..errors import ConfigError
from .numerics import SyncNumerics, check_numerics
from .stream import WeightBucket, WeightStream


class Receiver(Protocol):
    """Where a sync delivers the weights (see the module's docstring)."""

    receivers: Union[str, list[int]]  # the trainer ranks that materialize the tensors ("all": each)
    tied_once: bool                   # a tied weight under its first name only
    buffers: bool                     # persistent buffers too

    def begin(self, stream: WeightStream) -> None: ...
    def load(self, bucket: WeightBucket) -> None: ...
    def end(self) -> None: ...
    def logprobs(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]: ...


@dataclass(frozen=True)
class SyncReport:
    """One sync on this rank: what was sent, how long it took, and the numerics (every k-th sync)."""

    index: int
    bytes: int
    buckets: int
    seconds: float
    wait_seconds: float
    cap: int
    bound_bytes: int
    numerics: Optional[SyncNumerics] = None

    def __str__(self) -> str:
        line = (f"sync {self.index}: {self.bytes / 2**20:.1f} MiB in {self.buckets} buckets, {self.seconds:.3f} s "
                f"(cap {self.cap / 2**20:.1f} MiB)")
        return line + (f"; {self.numerics}" if self.numerics is not None else "")


class WeightSync:
    """Streams ``model``'s weights into ``receiver`` at each :meth:`sync` (collective over the trainer).

    ``dtype``, ``bucket_bytes``, ``overlap``, ``merge_adapters``: as ``model.stream_weights``.
    ``check_every``: compare log-probs at every k-th sync (0: never) on ``probe`` (token ids,
    or ``(input_ids, attention_mask)``); ``tolerance``: see numerics.py.
    """

    def __init__(self, model: Any, receiver: Receiver, *, dtype=None, bucket_bytes: int = 256 << 20,
                 overlap: bool = True, merge_adapters: bool = True, check_every: int = 0,
                 probe: Union[torch.Tensor, tuple, None] = None, tolerance: float = 3.0) -> None:
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise ConfigError(f"check_every must be an int >= 0 (0: never), got {check_every!r}")
        if check_every and probe is None:
            raise ConfigError("check_every > 0 needs a probe batch (probe=input_ids or (input_ids, attention_mask))")
        self.model, self.receiver = model, receiver
        self.options = dict(dtype=dtype, bucket_bytes=bucket_bytes, overlap=overlap, merge_adapters=merge_adapters)
        self.check_every, self.tolerance = check_every, tolerance
        self.probe = probe if isinstance(probe, tuple) or probe is None else (probe, None)
        self.count = 0

    def sync(self) -> SyncReport:
        """Stream the weights into the receiver (and check the numerics when it is the k-th sync)."""
        stream = self.model.stream_weights(receivers=self.receiver.receivers, tied_once=self.receiver.tied_once,
                                           buffers=self.receiver.buffers, **self.options)
        started = time.perf_counter()
        if stream.receives:
            self.receiver.begin(stream)
        for bucket in stream:
            if stream.receives:
                self.receiver.load(bucket)
        if stream.receives:
            self.receiver.end()
        seconds = time.perf_counter() - started
        self.count += 1
        numerics = None
        if self.check_every and self.count % self.check_every == 0:
            numerics = self.check(stream.dtype)
        return SyncReport(self.count, stream.stats.bytes, stream.stats.buckets, seconds, stream.stats.wait_seconds,
                          stream.cap, stream.bound_bytes, numerics)

    def check(self, rollout_dtype: Optional[torch.dtype]) -> Optional[SyncNumerics]:
        """The numerics report on the probe (None on a rank without the rollout's answer)."""
        input_ids, attention_mask = self.probe
        return check_numerics(self.model, self.receiver.logprobs, input_ids, attention_mask,
                              rollout_dtype=rollout_dtype, tolerance=self.tolerance)
