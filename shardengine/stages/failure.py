"""When a rank can no longer take part: stop for good, and tell every rank why.

:class:`FailureHandling` is the engine's collaborator for it; the reason is kept
in the step's state (step/phase.py, ``Phase.BROKEN``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..distributed.hybrid import HybridCommunicator
from ..errors import CollectiveError
from ..flat.units import in_backward
from ..step.agreement import ProgressCounters
from ..step.call_agreement import ranks_named
from ..step.phase import StepState


class FailureHandling:
    """``check_usable`` at every entry point; ``fail`` tears the group down."""

    def __init__(self, comm: HybridCommunicator, step_state: StepState, counters: ProgressCounters,
                 forward_ended: Callable[[], None], forward_raised: Optional[Callable[[], list[int]]],
                 announce_raised: Optional[Callable[[], None]]):
        """``forward_ended``: forgets the root forwards in progress (forward.py);
        ``forward_raised``: where a forward communicates (stage 3), ends it with the other
        ranks and says which raised (unit_scheduler.py), else None; ``announce_raised``: where the
        ranks can agree in the store, announces that this rank's forward raised, else None."""
        self.comm, self.step_state, self.counters = comm, step_state, counters
        self.forward_ended, self.forward_raised, self.announce_raised = forward_ended, forward_raised, announce_raised

    def check_usable(self) -> None:
        self.step_state.check_usable()
        if self.step_state.in_backward and not in_backward():
            self.backward_failed()

    def backward_failed(self) -> None:
        """[Note: a backward that raised]
        autograd runs the callback that ends a backward only when the backward completes, so
        one that raised leaves its reductions half launched, gradients waiting for buckets that
        never completed and (stage 3) units gathered for it. The next engine call finds the
        window still in ``BACKWARD`` with no backward running. Nothing can be resumed from
        there: the other ranks' collectives were paired with reductions this rank never
        launched (DDP refuses the next iteration for the same reason), so the engine stops
        for good with what to do, instead of reading freed buffers or misreporting a second
        gradient."""
        what = ("a backward pass raised before it finished; its gradient reductions were left half "
                "done")
        if self.comm.world_size > 1:
            self.fail(what)
        self.step_state.broken = (
            f"{what} (after {self.counters.steps} optimizer steps), so this engine stopped. Build "
            "the model again with shard() and resume from the last checkpoint.")
        raise CollectiveError(self.step_state.broken)

    def fail(self, what: str) -> None:
        """This rank's collectives may be out of step with the others': stop for good.

        Raises now and at every later engine call; the group is torn down so the
        other ranks' pending collectives fail at once instead of waiting out the timeout.
        """
        state = self.step_state
        if state.broken is None:
            state.broken = (
                f"rank {self.comm.rank}: {what} (after {self.counters.steps} optimizer steps); the "
                "ranks' collectives can no longer be paired, so this engine stopped. Every rank "
                "must run the same forwards, backwards and steps; handle the error on every rank "
                "(or none) and resume from the last checkpoint.")
            self.comm.abort(state.broken)
        raise CollectiveError(state.broken)

    def forward_failed(self, error: BaseException) -> None:
        """[Note: an exception inside forward]
        An exception that leaves the model's forward stops the engine only where the ranks'
        collectives can no longer be paired. Stage 3 ends the forward with the others
        in one round whatever happened (units/unit_order.py: their gathers are served, what
        this forward gathered is freed), and the round says which ranks raised. Stages 0-2
        issue nothing in a forward. So:

        * an evaluation forward (no grad) recovers on every rank: nothing was left half
          done (at stage 3 the others' gathers were served);
        * a training forward that raised on *every* rank recovers too (FSDP2's
          ``test_reset_iter_state_after_exception``): every rank counted it and none will
          backpropagate it. Stages 0-2 learn that in the rendezvous store (the ranks
          that raised announce it, step/call_agreement.py);
        * a training forward that raised on some ranks only stops every rank with a
          CollectiveError: the others go on to a backward that this rank will not run.
        A backward that raised part-way stays fatal (``backward_failed``).
        """
        state = self.step_state
        state.forward_depth = 0
        self.forward_ended()
        if isinstance(error, CollectiveError):  # a peer failed first: its cause, not ours
            state.broken = state.broken or str(error)
            return
        training = torch.is_grad_enabled()
        try:
            if self.forward_raised is not None:
                raised = self.forward_raised()
                if training and len(raised) < self.comm.world_size:
                    self.fail(f"a training forward pass raised on {ranks_named(raised)} only")
            elif training and self.comm.world_size > 1:
                self._agree_all_raised()
        except CollectiveError:
            pass  # the engine stopped; the original exception is the one to show now

    def _agree_all_raised(self) -> None:
        """Stages 0-2: every rank's training forward raised, or stop (see the Note)."""
        if self.announce_raised is None:  # no store to agree in: the others may be in their backward
            self.fail(f"a training forward pass raised on rank {self.comm.rank}")
        else:
            self.announce_raised()
