"""Bytes of activations kept for backward, on the device and on the host: now, and at most.

[Note: what counts as an activation kept]
A tensor autograd saves for backward (through the saved-tensor hooks of saved.py),
a matmul output a selective-checkpoint region caches, and a tensor a checkpointed
block's recomputation saves again in backward: each holds its *storage* (a view of a
larger buffer holds the whole buffer) until autograd lets it go. The ledger counts
each storage once however many saved tensors view it, from the first hold to the last
release, and keeps the most counted at once (the peak) per place: the device, or the
host where offload moved a copy. Parameters are never counted (saved.py skips them).
A hold is released either by a token (``keep``: the pack hook's result, dropped when
autograd frees the saved tensor) or by the storage itself being freed
(``keep_while_alive``: caches that torch owns). Both are measured, never estimated;
the estimator's trace runs this same ledger on fake tensors
(memory_estimator/model/traced_blocks.py: [Note: what is kept for backward, as the engine counts it]).

>>> import torch
>>> ledger = ActivationLedger()
>>> x = torch.ones(256)
>>> token, again = ledger.keep(x), ledger.keep(x[:8])   # one storage, counted once
>>> ledger.device.current, ledger.device.peak
(1024, 1024)
>>> del token, again
>>> ledger.device.current, ledger.device.peak
(0, 1024)
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..memory import LiveBytes


class _Entry:
    __slots__ = ("ref", "nbytes", "place", "tokens", "bound")

    def __init__(self, ref: weakref.ref, nbytes: int, place: LiveBytes):
        self.ref, self.nbytes, self.place = ref, nbytes, place
        self.tokens = 0      # holds released by a token
        self.bound = False   # a hold released only when the storage is freed


class Token:
    """One hold on a storage: released when this object is dropped."""

    __slots__ = ("_ledger", "_key", "__weakref__")

    def __init__(self, ledger: "ActivationLedger", key: int):
        self._ledger, self._key = ledger, key

    def __del__(self) -> None:
        self._ledger._release(self._key)


class ActivationLedger:
    """Activation bytes on the device and on the host (see the Note)."""

    def __init__(self) -> None:
        self.device = LiveBytes()
        self.host = LiveBytes()
        self._entries: dict[int, _Entry] = {}

    def keep(self, tensor: torch.Tensor, on_host: bool = False) -> Token:
        """Count ``tensor``'s storage until the returned token is dropped."""
        key = self._enter(tensor, on_host)
        self._entries[key].tokens += 1
        return Token(self, key)

    def keep_while_alive(self, tensor: torch.Tensor, on_host: bool = False) -> None:
        """Count ``tensor``'s storage until it is freed."""
        self._entries[self._enter(tensor, on_host)].bound = True

    def reset_peaks(self) -> None:
        self.device.reset_peak()
        self.host.reset_peak()

    def _enter(self, tensor: torch.Tensor, on_host: bool) -> int:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._entries:
            place = self.host if on_host else self.device
            ref = weakref.ref(storage, lambda _ref, key=key: self._forget(key))
            entry = self._entries[key] = _Entry(ref, storage.nbytes(), place)
            place.add(entry.nbytes)
        return key

    def _release(self, key: int) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.tokens -= 1
        if entry.tokens <= 0 and not entry.bound:
            self._forget(key)

    def _forget(self, key: int) -> None:
        entry: Optional[_Entry] = self._entries.pop(key, None)
        if entry is not None:
            entry.place.sub(entry.nbytes)
