"""When a rank can no longer take part: stop for good, and tell every rank why.

A mixin of :class:`~shardengine.stages.base.DataParallel`; the reason is kept in the
step's state (step/phase.py, ``Phase.BROKEN``).
"""

from __future__ import annotations

import torch

from ..errors import CollectiveError


class FailureHandling:
    """``check_usable`` at every entry point; ``fail`` tears the group down."""

    def check_usable(self) -> None:
        self.step_state.check_usable()

    def fail(self, what: str) -> None:
        """This rank's collectives may be out of step with the others': stop for good.

        Raises now and at every later engine call; the group is torn down so the
        other ranks' pending collectives fail at once instead of waiting out the timeout.
        """
        if self.step_state.broken is None:
            self.step_state.broken = (
                f"rank {self.comm.rank}: {what} (after {self.counters.steps} optimizer steps); the "
                "ranks' collectives can no longer be paired, so this engine stopped. Every rank "
                "must run the same forwards, backwards and steps; handle the error on every rank "
                "(or none) and resume from the last checkpoint.")
            self.comm.abort(self.step_state.broken)
        raise CollectiveError(self.step_state.broken)

    def forward_failed(self, error: BaseException) -> None:
        """An exception left a forward pass: with several ranks, training cannot go on."""
        self.step_state.forward_depth = 0
        self._forward_records = []
        if isinstance(error, CollectiveError):  # a peer failed first: its cause, not ours
            self.step_state.broken = self.step_state.broken or str(error)
            return
        if self.world > 1 and (torch.is_grad_enabled() or self.forward_communicates):
            try:
                self.fail(f"a forward pass raised on rank {self.comm.rank}")
            except CollectiveError:
                pass  # the original exception is the one to show now
