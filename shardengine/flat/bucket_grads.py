"""A flat bucket's gradients: adopted or absorbed per parameter, weighted, reduced, handed to the optimizer.

A mixin of :class:`~shardengine.flat.bucket.FlatBucket` (its tensors are
described there). ``full_grad`` is persistent at stages 0-1, where autograd adds
straight into it (``adopt_grad``), and transient at stages 2-3, where each
gradient is copied in once (``absorb_grad``); the micro-step's batch weight
(step/batch_weights.py) is applied on the way, and ``grad_shard`` accumulates the
reduced slice until the optimizer's pieces read it (``set_piece_grads``).
Nothing here communicates.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .guard import set_grad_sharded
from .layout import FlatLayout, ParamSlot


class BucketGradients:
    """The gradient half of a FlatBucket."""

    params: list[nn.Parameter]
    layout: FlatLayout
    full_param: torch.Tensor
    master: Optional[torch.Tensor]
    full_grad: Optional[torch.Tensor]
    grad_shard: Optional[torch.Tensor]
    grad_home: Optional[torch.device]  # where grad_shard is kept (None: where it was reduced)
    grad_dtype: torch.dtype
    window_fresh: bool
    local_factor: float
    _unwritten: Optional[set[int]]
    _before_zero_weight: Optional[tuple]
    master_pieces: list

    @staticmethod
    def slot_view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        return flat[slot.offset:slot.end].view(slot.shape)

    def alloc_full_grad(self) -> torch.Tensor:
        """A zero-filled ``full_grad`` (persistent at stages 0-1; stages 2-3 allocate theirs at the
        launch, unwritten: :meth:`alloc_unwritten_grad`)."""
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype,
                                         device=self.full_param.device)
        return self.full_grad

    def free_full_grad(self) -> None:
        self.full_grad = None
        self._unwritten = None

    def grad_view(self, index: int) -> torch.Tensor:
        return self.slot_view(self.full_grad, self.layout.slots[index])

    def adopt_grad(self, index: int) -> None:
        """Make ``param.grad`` a view into ``full_grad`` (stages 0-1, no mixed precision).

        Autograd adds into an existing ``.grad`` in place, so once adopted the
        next backward accumulates straight into the bucket. A ``None`` grad
        means zero (``zero_grad(set_to_none=True)``); a fresh tensor from
        autograd is copied in once.
        """
        param, view = self.params[index], self.grad_view(index)
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr() or view.numel() == 0:
            view.copy_(grad)
        param.grad = view

    def absorb_grad(self, index: int, factor: float = 1.0) -> None:
        """Add ``factor`` times ``param.grad`` into ``full_grad`` (in the reduce dtype) and drop it.

        [Note: transient gradient buffers are not zero-filled]
        At stages 2-3 the buffer lives for one backward. Zero-filling it and then
        adding every gradient would touch it twice; instead the first gradient of
        each slot is copied in, and :meth:`zero_unwritten` clears what no gradient
        reached (and the padding) just before the reduction. ``factor`` is the
        micro-step's batch weight (step/batch_weights.py); 0 adds nothing, not even a NaN.
        """
        param = self.params[index]
        if param.grad is None:
            return
        self.absorb_tensor(index, param.grad, factor)
        param.grad = None

    def alloc_unwritten_grad(self) -> torch.Tensor:
        """A ``full_grad`` left uninitialised, every slot unwritten (see the Note above)."""
        if self.full_grad is None:
            self.full_grad = torch.empty(self.layout.padded_numel, dtype=self.grad_dtype,
                                         device=self.full_param.device)
            self._unwritten = set(range(len(self.params)))
        return self.full_grad

    def absorb_tensor(self, index: int, grad: torch.Tensor, factor: float = 1.0) -> None:
        """:meth:`absorb_grad` of a gradient held elsewhere than ``param.grad``."""
        self.alloc_unwritten_grad()
        view = self.grad_view(index)
        first = self._unwritten is not None and index in self._unwritten
        if factor == 0.0:
            if first:
                view.zero_()
        elif first:
            view.copy_(grad)
            if factor != 1.0:
                view.mul_(factor)
        else:
            view.add_(grad.to(view.dtype), alpha=factor)
        if first:
            self._unwritten.discard(index)

    # [Note: weighted micro-steps in a persistent gradient]
    # At stages 0-1 autograd adds each micro-step's gradient straight into the
    # bucket (adopt_grad), where no factor can be applied to it alone. So the
    # local gradient is kept as (1 / local_factor) * sum_j f_j g_j: when a
    # micro-step's factor differs from the last one, what is there is rescaled
    # first (rare: weights change), and the factor itself is multiplied in just
    # before the reduction (nothing when it is 1). A micro-step of factor 0 must
    # leave no trace (its loss may even be NaN), so the buffer is put back as it was.

    def prepare_local_factor(self, factor: float) -> None:
        """Before a backward accumulates into this (adopted) bucket with batch-weight ``factor``."""
        held = [p.grad is not None for p in self.params]
        if factor == 0.0:
            self._before_zero_weight = (self.full_grad.clone() if any(held) else None, held)
            return
        if factor != self.local_factor:
            if any(held):
                self.full_grad.mul_(self.local_factor / factor)
            self.local_factor = factor

    def undo_zero_weight(self) -> None:
        """After a factor-0 backward: the gradients it accumulated are taken out again."""
        if self._before_zero_weight is None:
            return
        saved, held = self._before_zero_weight
        self._before_zero_weight = None
        if saved is not None:
            self.full_grad.copy_(saved)
        for param, had in zip(self.params, held):
            if not had:
                param.grad = None  # adopt_grad reads None as zero

    def apply_local_factor(self) -> None:
        """Just before the reduction: multiply in the pending factor (see the Note)."""
        self.undo_zero_weight()
        if self.local_factor != 1.0:
            self.full_grad.mul_(self.local_factor)
            self.local_factor = 1.0

    def zero_unwritten(self) -> None:
        """Zero the slots of a transient ``full_grad`` that no gradient reached, and the padding."""
        if self._unwritten is None:
            return
        for index in sorted(self._unwritten):
            self.grad_view(index).zero_()
        for start, end in self.layout.padding_spans():
            self.full_grad[start:end].zero_()
        self._unwritten = None

    def accumulate_grad_shard(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced gradient to ``grad_shard``; a new window adopts ``reduced``."""
        if self.window_fresh or self.grad_shard is None:
            # the caller hands it over: no copy, unless it is kept on the host (offload_params)
            self.grad_shard = reduced if self.grad_home is None else self._copy_home(reduced)
        else:
            self.grad_shard.add_(reduced.to(self.grad_shard.device))
        self.window_fresh = False

    def _copy_home(self, reduced: torch.Tensor) -> torch.Tensor:
        """``reduced`` copied into a new buffer on ``grad_home`` (pinned there with a GPU). A real
        copy even where the host is the device (a CPU run), so that path runs the same code."""
        home = torch.empty(reduced.shape, dtype=reduced.dtype, device=self.grad_home,
                           pin_memory=self.grad_home.type == "cpu" and torch.cuda.is_available())
        return home.copy_(reduced)  # blocking: the host step reads it next

    @property
    def grad_device(self) -> torch.device:
        """Where the reduced gradient shard is kept."""
        return self.grad_home or self.full_param.device

    def master_grad(self) -> Optional[torch.Tensor]:
        """``grad_shard`` as the master's gradient (a view when dtype and device agree)."""
        if self.window_fresh or self.grad_shard is None:
            return None  # nothing reduced since the last step: the optimizer skips it
        self.wait_for_master_copy()  # the step about to write the master (offload: on the host)
        return self.grad_shard.to(dtype=self.master.dtype, device=self.master.device)

    def hand_run_grads(self, pieces: list, skip_slots: frozenset = frozenset()) -> list[nn.Parameter]:
        """Point ``pieces``' ``.grad`` (consecutive in ``master``) at a master-dtype copy of their
        span of ``grad_shard``, made for them alone; the parameters handed one (see [Note: the
        step inside backward under a byte cap] in optim/step_groups.py)."""
        if self.window_fresh or self.grad_shard is None or not pieces:
            return []
        self.wait_for_master_copy()
        lo, hi = pieces[0].master_start, pieces[-1].master_end
        grad = self.grad_shard[lo:hi].to(dtype=self.master.dtype, device=self.master.device)
        handed = [piece for piece in pieces if piece.slot not in skip_slots]
        for piece in handed:
            piece.param.grad = grad[piece.master_start - lo:piece.master_end - lo].view(piece.param.shape)
        return [piece.param for piece in handed]

    def set_piece_grads(self, grad: Optional[torch.Tensor], skip_slots: frozenset = frozenset()) -> None:
        """Point every piece's ``.grad`` at its slice of ``grad`` (None: skipped by the optimizer)."""
        for piece in self.master_pieces:
            skipped = grad is None or piece.slot in skip_slots
            piece.param.grad = None if skipped else \
                grad[piece.master_start:piece.master_end].view(piece.param.shape)

    def close_pieces(self) -> None:
        """The step is over (or raised): the pieces' gradients are dropped and guarded again (see
        [Note: the optimizer's pieces outside the step] in flat/guard.py)."""
        self.set_piece_grads(None)
        set_grad_sharded([piece.param for piece in self.master_pieces], True)
