"""A rendezvous store that records every request sent through it, for counting and replay.

The engine's control plane talks to the rendezvous store (``TCPStore`` on the rank-0
host) at startup and on announced calls, never during a training step
(step/call_agreement.py). :class:`RecordingStore` is how that is checked and measured:
it forwards each request to the real store and appends ``(phase, op, key, nbytes)``
to :attr:`RecordingStore.requests`. Passed to ``init_process_group(store=...)`` it sees
everything: the backend's rendezvous (through ``PrefixStore``), ``new_group``, and the
engine's own keys. ``benchmarks/bench_control_plane.py`` records real runs with it and
replays them against one ``TCPStore`` at thousands of simulated ranks;
``tests/engine/test_control_plane.py`` counts the requests of a training step.

>>> import datetime, torch.distributed as dist
>>> server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
>>> store = RecordingStore(server)
>>> store.phase = "demo"
>>> store.set("a", b"1"); store.add("n", 2)
2
>>> [(r.phase, r.op, r.key) for r in store.requests]
[('demo', 'set', 'a'), ('demo', 'add', 'n')]
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class StoreRequest:
    """One request as the store received it: ``op`` is the store method's name."""

    phase: str
    op: str
    key: str        # the first key (``check``/``wait``/``multi_get``: of several, see ``keys``)
    nbytes: int     # value bytes sent (set, compare_set, append) or the amount (add)
    keys: int = 1   # how many keys the request names
    seconds: float = 0.0  # time the request took, as the caller saw it


class RecordingStore(dist.Store):
    """Forwards every request to ``inner`` and records it (see the module's docstring).

    Thread-safe for recording: the backend's threads (Gloo's rendezvous) call it too.
    Set :attr:`phase` to label what follows.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.phase = "startup"
        self.requests: list[StoreRequest] = []
        self._lock = threading.Lock()

    def _record(self, op: str, keys: list[str], nbytes: int, started: float) -> None:
        request = StoreRequest(self.phase, op, keys[0] if keys else "", nbytes, len(keys),
                               time.perf_counter() - started)
        with self._lock:
            self.requests.append(request)

    def set(self, key: str, value) -> None:
        started = time.perf_counter()
        self.inner.set(key, value)
        self._record("set", [key], len(value), started)

    def get(self, key: str) -> bytes:
        started = time.perf_counter()
        value = self.inner.get(key)
        self._record("get", [key], 0, started)
        return value

    def add(self, key: str, amount: int) -> int:
        started = time.perf_counter()
        value = self.inner.add(key, amount)
        self._record("add", [key], amount, started)
        return value

    def check(self, keys: list[str]) -> bool:
        started = time.perf_counter()
        found = self.inner.check(keys)
        self._record("check", list(keys), 0, started)
        return found

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        started = time.perf_counter()
        try:
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
        finally:
            self._record("wait", list(keys), 0, started)

    def compare_set(self, key: str, expected, desired) -> bytes:
        started = time.perf_counter()
        value = self.inner.compare_set(key, expected, desired)
        self._record("compare_set", [key], len(desired), started)
        return value

    def append(self, key: str, value) -> None:
        started = time.perf_counter()
        self.inner.append(key, value)
        self._record("append", [key], len(value), started)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        started = time.perf_counter()
        values = self.inner.multi_get(keys)
        self._record("multi_get", list(keys), 0, started)
        return values

    def multi_set(self, keys: list[str], values: list) -> None:
        started = time.perf_counter()
        self.inner.multi_set(keys, values)
        self._record("multi_set", list(keys), sum(len(v) for v in values), started)

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return True

    # -- reading the record

    def mark(self, phase: str) -> int:
        """Start ``phase``; returns how many requests were recorded before it."""
        with self._lock:
            self.phase = phase
            return len(self.requests)

    def since(self, start: int) -> list[StoreRequest]:
        """The requests recorded after :meth:`mark` returned ``start``."""
        with self._lock:
            return self.requests[start:]


def default_store_recording() -> Optional[RecordingStore]:
    """The :class:`RecordingStore` under the default group's store, if the group was made on one."""
    store = dist.distributed_c10d._get_default_store()
    while store is not None and not isinstance(store, RecordingStore):
        store = getattr(store, "underlying_store", None)
    return store
