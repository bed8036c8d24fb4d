"""One tiny all-reduce per optimizer step that every rank's step depends on.

[Note: the step-sync vector]
Before an optimizer step each rank contributes a small float64 vector and the
ranks sum it. It carries:

* which trainable parameters got a gradient on this rank in this window, so a
  parameter with no gradient on any rank is left exactly as torch leaves it
  (no update, no weight decay, no step-count advance);
* fp16: whether this rank saw a non-finite gradient (skip on every rank);
* the rank's progress counters (optimizer steps, training forwards, backward
  passes since ``shard()``), each as ``c`` and ``c**2``: the sums show whether
  all ranks agree (their variance is zero) without a second collective, so a
  rank that skipped or repeated a forward, backward or step is caught here,
  on every rank at once, instead of its collectives silently pairing with the
  other ranks' from a different step.

float64 keeps the counts exact (integers below 2**53).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import CollectiveError, Communicator

_COUNTER_NAMES = ("optimizer steps", "training forward passes", "backward passes")
LABEL = "step_sync"  # how comm_stats() counts this collective
_HEADER = 2 + 2 * len(_COUNTER_NAMES)


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


@dataclass(frozen=True)
class StepAgreement:
    """The summed vector, decoded."""

    any_overflow: bool
    ranks_using: list[int] = field(default_factory=list)  # per trainable parameter


def exchange(comm: Communicator, counters: ProgressCounters, overflow: bool,
             used_flags: bytearray, device: torch.device) -> StepAgreement:
    """Sum every rank's vector; raise :class:`CollectiveError` on every rank if they are out of step."""
    header = [1.0, float(overflow)]
    for value in counters.as_tuple():
        header += [float(value), float(value) ** 2]
    flags = torch.frombuffer(used_flags, dtype=torch.uint8) if len(used_flags) else torch.zeros(0)
    vector = torch.cat([torch.tensor(header, dtype=torch.float64), flags.to(torch.float64)]).to(device)
    comm.all_reduce(vector, label=LABEL).wait()
    summed = [round(value) for value in vector.cpu().tolist()]  # integers: exact Python ints
    ranks = summed[0]
    for index in range(len(_COUNTER_NAMES)):
        total, squares = summed[2 + 2 * index], summed[3 + 2 * index]
        if squares * ranks != total * total:  # Cauchy-Schwarz: equal only if every rank's count is
            raise _out_of_step(comm, counters)
    return StepAgreement(summed[1] > 0, summed[2 + 2 * len(_COUNTER_NAMES):])


def _out_of_step(comm: Communicator, counters: ProgressCounters) -> CollectiveError:
    """Every rank detected it from the same sums, so every rank can afford one more collective."""
    every = comm.all_gather_object(counters.as_tuple())
    rows = "; ".join(f"rank {rank}: " + ", ".join(f"{value} {name}" for value, name in zip(values, _COUNTER_NAMES))
                     for rank, values in enumerate(every))
    return CollectiveError(
        f"ranks are out of step at this optimizer step ({rows}). A rank skipped or repeated a "
        "forward, backward or optimizer step (for example an exception caught on one rank only, "
        "or a loop with a different number of iterations per rank), so its collectives were "
        "paired with other ranks' from a different step. Every rank must run the same sequence "
        "of training forwards, backwards and steps (use model.join() for uneven data); resume "
        "from the last checkpoint.")
