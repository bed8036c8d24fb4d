"""``Work``: the handle of one logical collective a :class:`Communicator` issued."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .communicator import Communicator


class Work:
    """Handle of one logical collective (one or more backend calls); ``wait()`` is idempotent."""

    def __init__(self, comm: "Communicator", kind: str, handles: tuple = ()):
        self._comm, self._kind = comm, kind
        self._handles = [handle for handle in handles if handle is not None]
        self._on_done: list = []
        self._done = False

    def then(self, on_done) -> "Work":
        """Run ``on_done()`` once the collective has completed (at ``wait()``, or now if it
        already has), after any callbacks registered before it."""
        self._on_done.append(on_done)
        if self._done:
            self.wait()
        return self

    def wait(self) -> None:
        if self._handles:
            started = time.perf_counter()
            try:
                for handle in self._handles:
                    self._comm.wait_for(handle)
            except RuntimeError as error:
                raise self._comm.explain(self._kind, error) from error
            finally:
                self._comm.stats.seconds += time.perf_counter() - started
            self._handles = []
        self._done = True
        callbacks, self._on_done = self._on_done, []
        for on_done in callbacks:
            on_done()

