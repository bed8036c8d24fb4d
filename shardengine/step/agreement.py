"""One small all-reduce that every rank's optimizer step depends on.

[Note: the step-sync vector]
Before an optimizer step each rank contributes a small float64 vector and the
ranks sum it. It carries:

* which trainable parameters got a gradient on this rank in this window, so a
  parameter with no gradient on any rank is left exactly as torch leaves it
  (no update, no weight decay, no step-count advance);
* fp16: whether this rank saw a non-finite gradient (skip on every rank);
* the batch weights of the window (see step/batch_weights.py): their sum and how many
  micro-steps each rank ran, from which every rank derives the same divisor;
* the rank's progress counters (optimizer steps, training forwards, backward
  passes since ``shard()``), each as ``c`` and ``c**2``: the sums show whether
  all ranks agree (their variance is zero) without a second collective, so a
  rank that skipped or repeated a forward, backward or step is caught here,
  on every rank at once, instead of its collectives silently pairing with the
  other ranks' from a different step.

Under ``model.join()`` (step/join.py) the same vector, with a ``kind``, is also how
ranks that ran out of data learn what the others do next; a rank that has
joined contributes zeros, and only active ranks' counters are compared.

float64 keeps the counts exact (integers below 2**53).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import CollectiveError

if TYPE_CHECKING:  # the estimator imports vector_bytes: no process-group code at import
    from ..distributed.communicator import Communicator

_COUNTER_NAMES = ("optimizer steps", "training forward passes", "backward passes")
LABEL = "step_sync"  # how comm_stats() counts this collective



class Announcement(enum.IntEnum):
    """What an active rank's vector is for (step/join.py): the window's agreement before a
    step, or the next collective-bearing call a joined rank must serve. The values travel
    in the summed float64 vector (averaged over the active ranks), so they are fixed."""

    SYNC = 1      # the window's agreement (every rank, before clip or step)
    FORWARD = 2   # a training forward (flag: grad enabled)
    CLIP = 3      # clip_grad_norm_ (aux: max_norm, norm_type)
    STEP = 4      # an optimizer step (extra: the hyperparameters)
    BACKWARD = 5  # a backward (flag: it reduces; aux[0]: the window is fresh)

# active, kind, flag, overflow, counters (c, c^2) x 3, weight, micro-steps, ran any, aux x 2,
# ranks asking for an input template (step/join.py), hyperparameter digest (h, h^2)
_HEADER = 4 + 2 * len(_COUNTER_NAMES) + 8


def vector_bytes(trainable_params: int) -> int:
    """Bytes of the summed vector (float64): the header and one flag per trainable parameter."""
    return 8 * (_HEADER + trainable_params)


@dataclass
class ProgressCounters:
    """What this rank has done since ``shard()``; equal on every rank when in step."""

    steps: int = 0
    forwards: int = 0
    backwards: int = 0

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.steps, self.forwards, self.backwards)

    def catch_up(self, steps: int, forwards: int, backwards: int) -> None:
        """Take the most advanced rank's counts (``model.join()`` after uneven inputs)."""
        self.steps, self.forwards, self.backwards = steps, forwards, backwards


@dataclass
class Contribution:
    """One rank's part of the vector."""

    counters: ProgressCounters
    used_flags: bytearray
    kind: Announcement = Announcement.SYNC
    active: bool = True
    flag: bool = False            # BACKWARD: it reduces (not under no_sync); FORWARD: grad enabled
    overflow: bool = False
    weight: float = 0.0           # the window's batch weights (step/batch_weights.py)
    micro_steps: int = 0          # backward passes in the window
    aux: tuple[float, float] = (0.0, 0.0)  # CLIP: max_norm, norm_type
    needs_template: bool = False  # step/join.py: a joined stage-3 rank with no inputs to replay
    extra: tuple[float, ...] = ()  # step/join.py: the active ranks' optimizer hyperparameters
    hyper_digest: float = 0.0     # SYNC: one number for the optimizer's lr, betas, ... and the
                                  # trainable-set plan (stages/replan.py; equal if in step)


@dataclass(frozen=True)
class Agreement:
    """The summed vector, decoded."""

    active_ranks: int
    kind: int                      # an Announcement; 0 when no rank is active
    flag: bool
    any_overflow: bool
    weight: float
    micro_steps: int
    ranks_with_micro_steps: int
    aux: tuple[float, float]
    needs_template: int = 0
    ranks_using: list[int] = field(default_factory=list)  # per trainable parameter
    extra: list[float] = field(default_factory=list)  # averaged over the active ranks


def exchange(comm: Communicator, mine: Contribution, device: torch.device) -> Agreement:
    """Sum every rank's vector; raise :class:`CollectiveError` on every rank if active ranks
    are out of step."""
    on = float(mine.active)
    header = [on, mine.kind * on, float(mine.flag) * on, float(mine.overflow)]
    for value in mine.counters.as_tuple():
        header += [float(value) * on, float(value) ** 2 * on]
    header += [float(mine.weight), float(mine.micro_steps), float(mine.micro_steps > 0),
               mine.aux[0] * on, mine.aux[1] * on, float(mine.needs_template),
               mine.hyper_digest * on, mine.hyper_digest ** 2 * on]
    flags = torch.frombuffer(mine.used_flags, dtype=torch.uint8) if len(mine.used_flags) else torch.zeros(0)
    extra = [value * on for value in mine.extra]
    vector = torch.cat([torch.tensor(header + extra, dtype=torch.float64), flags.to(torch.float64)]).to(device)
    comm.all_reduce(vector, label=LABEL).wait()
    summed = comm.host_copy(vector).tolist()  # on a device: a host wait that notices a stopped peer
    exact = [round(value) for value in summed]  # counts: exact Python ints
    active = exact[0]
    for index in range(len(_COUNTER_NAMES)):
        total, squares = exact[4 + 2 * index], exact[5 + 2 * index]
        if squares * active != total * total:  # Cauchy-Schwarz: equal only if every count is
            raise _out_of_step(comm, mine)
    at = 4 + 2 * len(_COUNTER_NAMES)
    total, squares = summed[at + 6], summed[at + 7]
    if abs(squares * active - total * total) > 1e-9 * max(total * total, 1e-30):
        raise _hyperparameters_differ(comm, mine)
    per_active = max(active, 1)
    flags_at = _HEADER + len(extra)
    return Agreement(active, round(summed[1] / per_active), exact[2] == active and active > 0,
                     exact[3] > 0, summed[at], exact[at + 1], exact[at + 2],
                     (summed[at + 3] / per_active, summed[at + 4] / per_active), exact[at + 5],
                     exact[flags_at:], [value / per_active for value in summed[_HEADER:flags_at]])


def _hyperparameters_differ(comm: Communicator, mine: Contribution) -> CollectiveError:
    every = comm.all_gather_object(mine.hyper_digest if mine.active else None)
    rows = ", ".join(f"rank {rank}: {value:.6g}" for rank, value in enumerate(every) if value is not None)
    return CollectiveError(
        f"the ranks' optimizer hyperparameters (lr, betas, weight decay, ...) differ at this step "
        f"(digest {rows}): each rank would step its shards or replicas differently. A learning-rate "
        "scheduler stepped a different number of times on some rank (after model.join(), a rank "
        "that joined early stepped its scheduler less: advance it to model.steps_taken), a "
        "param group was changed on one rank only, or the trainable set (requires_grad, "
        "add_param_group) changed on some ranks only (the digest includes the engine's plan, "
        "see stages/replan.py).")


def _out_of_step(comm: Communicator, mine: Contribution) -> CollectiveError:
    """Every rank detected it from the same sums, so every rank can afford one more collective."""
    every = comm.all_gather_object(mine.counters.as_tuple() if mine.active else None)
    rows = "; ".join(f"rank {rank}: " + ", ".join(f"{value} {name}" for value, name in zip(values, _COUNTER_NAMES))
                     for rank, values in enumerate(every) if values is not None)
    return CollectiveError(
        f"ranks are out of step at this optimizer step ({rows}). A rank skipped or repeated a "
        "forward, backward or optimizer step (for example an exception caught on one rank only, "
        "or a loop with a different number of iterations per rank), so its collectives were "
        "paired with other ranks' from a different step. Every rank must run the same sequence "
        "of training forwards, backwards and steps (use model.join() for uneven data); resume "
        "from the last checkpoint.")
