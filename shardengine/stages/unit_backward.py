"""When a stage-3 unit's backward is over, so that its gathered parameters may go.

[Note: a unit's backward ends with its input gradients, not its gradients]
A unit gathered for backward used to be freed as soon as every trainable
parameter of it had received its gradient. That is the end of its backward
only when every parameter trains: a frozen weight is still read to compute
the gradient of the unit's *input* (LoRA: ``y = W x + B A x`` with W frozen;
autograd may accumulate A's and B's gradients before it multiplies by W), and
a unit with no trainable parameter at all needs its weights for exactly that.
A unit whose parameters all train needs nothing more: the autograd node that
reads a weight computes the input's and the weight's gradients together, and
the weight's gradient is accumulated after it. So a unit holding frozen
parameters stays gathered while any of its backward passes is still open:

* a forward that runs with grad enabled, outside backward, and has inputs that
  require grad opens a *pass*. The pass becomes pending when a gradient of
  the unit's output arrives (its backward has started) and is closed by a
  multi-grad hook on those inputs (all their gradients are computed, so
  nothing of the unit's graph is left to run). A pass whose output gets no
  gradient (a forward never backpropagated) is never pending and costs nothing.
* a backward that reaches the unit inside a *nested* graph task (reentrant
  activation checkpointing runs the recomputed forward's backward as one)
  holds the unit until that task ends; the task's end is exactly where the
  recomputed region's backward is over.

The multi-grad hook waits for each input's *whole* gradient: an input that
other units read as well (T5 hands every block the first block's position
bias) closes the pass only once they are all done, so such a unit, when it
holds frozen parameters, may stay gathered longer than its own backward
(never shorter: correct, at some memory). Only units with frozen parameters
open passes, so fully trained models keep the arrival rule alone.

Forwards run by non-reentrant checkpointing's recomputation open no pass:
their graph is never differentiated (only its saved tensors are used, by
the original graph, whose pass is the one that counts). The engine frees
every unit at the end of the outermost backward regardless, so a pass that is
never closed (``backward(inputs=...)`` that skips the unit's input) holds its
unit only until then.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from ..flat.units import in_backward, tensors_in


def current_graph_task() -> int:
    return torch._C._current_graph_task_id()


def when_backward_reaches(tensor: torch.Tensor, hook: Callable[[], None]) -> None:
    """Call ``hook`` when backward is about to run the op that made ``tensor`` (a unit's output),
    after every hook on ``tensor``'s gradient: see [Note: a unit's pre-backward comes last].

    [Note: a unit's pre-backward comes last]
    Unit k's input is unit k-1's output ``y``. Two hooks wait on ``y``'s gradient:
    k-1's pre-backward (gather k-1, prefetch k-2) and the multi-grad hook that closes
    k's pass ([Note: a unit's backward ends with its input gradients]: k, holding
    frozen weights, is freed there). Tensor hooks run in the order they were
    registered, and k-1's post-forward registers first, so as tensor hooks k-2 was
    gathered while k still was: three units alive through a LoRA backward (the
    allocator tracker saw 3 units + the activations at N = 2, where the promise is the
    unit computed and the one prefetched). autograd runs a node's *tensor* pre-hooks
    before its *node* pre-hooks (engine.cpp, ``call_function``), so the pre-backward
    is a pre-hook of ``y``'s node: k is released first, then k-1's backward gathers
    and prefetches. FSDP2 gets the same order from an autograd function on the
    unit's inputs (its post-backward runs as a node before the gradient reaches
    k-1). A leaf has no node that makes it (a parameter returned as an output): its
    own gradient hook stands in.
    """
    node = tensor.grad_fn
    if node is None:
        tensor.register_hook(lambda grad: hook())
    else:
        node.register_prehook(lambda grad_outputs: hook())


class UnitPass:
    """One forward of one unit whose inputs require grad (see the Note)."""

    __slots__ = ("unit", "closed_in")

    def __init__(self, unit: Hashable):
        self.unit = unit
        self.closed_in = -2  # the graph task whose backward closed it (-2: none yet)


class UnitBackwardTracker:
    """Which units still have a backward running through them.

    ``release(unit)`` is called when a unit's last open pass closes; the engine
    then frees it if its gradients have all arrived too.
    """

    def __init__(self, release: Callable[[Hashable], None]):
        self._release = release
        self._open: dict[Hashable, set] = {}   # unit -> pending passes / nested tasks
        self.outer_task = -1                   # the graph task of the engine's backward

    def begin(self) -> None:
        self.outer_task = current_graph_task()

    def end(self) -> None:
        self._open.clear()
        self.outer_task = -1

    def busy(self, unit: Hashable) -> bool:
        return bool(self._open.get(unit))

    def on_forward(self, unit: Hashable, args, kwargs) -> "UnitPass | None":
        """At a unit's pre-forward: open a pass when its input gradients will be computed."""
        if not torch.is_grad_enabled() or in_backward():
            return None
        inputs = list(tensors_in((args, kwargs)))
        if not inputs:
            return None
        unit_pass = UnitPass(unit)
        torch.autograd.graph.register_multi_grad_hook(
            inputs, lambda grads, unit_pass=unit_pass: self._close(unit_pass), mode="all")
        return unit_pass

    def on_output_grad(self, unit: Hashable, unit_pass: "UnitPass | None") -> None:
        """A gradient of the unit's output arrived: its backward is running."""
        task = current_graph_task()
        if self.outer_task != -1 and task != self.outer_task:
            self._hold_for_nested_task(unit, task)
        elif unit_pass is not None and unit_pass.closed_in != task:
            self._open.setdefault(unit, set()).add(unit_pass)

    def _close(self, unit_pass: UnitPass) -> None:
        unit_pass.closed_in = current_graph_task()
        held = self._open.get(unit_pass.unit)
        if held and unit_pass in held:
            held.discard(unit_pass)
            if not held:
                self._release(unit_pass.unit)

    def _hold_for_nested_task(self, unit: Hashable, task: int) -> None:
        held = self._open.setdefault(unit, set())
        marker = ("task", task)
        if marker in held:
            return
        held.add(marker)

        def task_done() -> None:
            held.discard(marker)
            if not held:
                self._release(unit)

        torch.autograd.Variable._execution_engine.queue_callback(task_done)
