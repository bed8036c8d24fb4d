"""``FlatBucket``: parameters packed into one padded flat buffer, sharded over ranks.

A bucket holds parameters that share a dtype, a device, an optimizer param
group and ``requires_grad``. Its tensors:

``full_param``   all parameters end to end, padded to a multiple of N. Every
                 parameter is re-pointed at its slice of it, so the model keeps
                 its ``nn.Parameter`` objects (identity matters: tied weights,
                 optimizers, user code). Stage 3 frees its storage between uses.
``param_shard``  this rank's slice: a view into ``full_param`` at stages 0-2,
                 its own storage at stage 3 (the only persistent copy).
``master``       the ``nn.Parameter`` the sharded optimizer steps; shares
                 ``param_shard``'s storage.
``full_grad``    gradients laid out like ``full_param``: persistent at stages 0-1
                 (``param.grad`` are views into it), transient at stages 2-3.
``grad_shard``   stage 2-3: this rank's reduced gradient, accumulated over
                 micro-steps; it is ``master.grad`` while gradients exist.

Nothing here communicates; the stage strategies call the communicator.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layout import FlatLayout, ParamSlot


def point_param_at(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param`` use ``view``'s storage, keeping the Python object."""
    if param.is_meta:
        # set_data refuses meta -> real; swap_tensors keeps identity and requires_grad.
        torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
    else:
        param.data = view


class FlatBucket:
    def __init__(self, params: list[nn.Parameter], group_index: Optional[int],
                 rank: int, world_size: int, device: torch.device):
        self.params = params
        self.group_index = group_index
        self.requires_grad = params[0].requires_grad
        self.dtype = params[0].dtype
        self.layout = FlatLayout.build([tuple(p.shape) for p in params], world_size)
        self.owned = slice(*self.layout.owned_range(rank))
        self.full_param = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=device)
        self.param_shard = self.full_param[self.owned]
        self.master: Optional[nn.Parameter] = None
        self.full_grad: Optional[torch.Tensor] = None
        self.grad_shard: Optional[torch.Tensor] = None
        self._pack_params()

    # ------------------------------------------------------------------ parameters

    def _pack_params(self) -> None:
        for param, slot in zip(self.params, self.layout.slots):
            view = self.slot_view(self.full_param, slot)
            if not param.is_meta:
                view.copy_(param.detach())
            point_param_at(param, view)

    @staticmethod
    def slot_view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        return flat[slot.offset:slot.end].view(slot.shape)

    def make_master(self) -> nn.Parameter:
        """The parameter the sharded optimizer steps (shares ``param_shard``)."""
        if self.master is None:
            self.master = nn.Parameter(self.param_shard, requires_grad=self.requires_grad)
        return self.master

    def shard_params(self) -> None:
        """Stage 3: keep only this rank's slice; free the full buffer."""
        self.param_shard = self.param_shard.clone()
        if self.master is not None:
            self.master.data = self.param_shard
        self.free_full_params()

    @property
    def full_params_live(self) -> bool:
        return self.full_param.untyped_storage().nbytes() > 0

    def free_full_params(self) -> None:
        self.full_param.untyped_storage().resize_(0)

    def alloc_full_params(self) -> None:
        nbytes = self.full_param.numel() * self.full_param.element_size()
        self.full_param.untyped_storage().resize_(nbytes)

    # ------------------------------------------------------------------ gradients

    def alloc_full_grad(self) -> torch.Tensor:
        if self.full_grad is None:
            self.full_grad = torch.zeros_like(self.full_param)
        return self.full_grad

    def free_full_grad(self) -> None:
        self.full_grad = None

    def grad_view(self, index: int) -> torch.Tensor:
        return self.slot_view(self.full_grad, self.layout.slots[index])

    def adopt_grad(self, index: int) -> None:
        """Stages 0-1: make ``param.grad`` a view into ``full_grad``.

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

    def absorb_grad(self, index: int) -> None:
        """Stages 2-3: add ``param.grad`` into the transient ``full_grad`` and drop it."""
        param = self.params[index]
        if param.grad is not None:
            self.alloc_full_grad()
            self.grad_view(index).add_(param.grad)
            param.grad = None

    def store_reduced_shard(self, reduced: torch.Tensor) -> None:
        """Stages 2-3: accumulate this rank's reduced gradient into ``grad_shard``."""
        master = self.make_master()
        if self.grad_shard is None:
            self.grad_shard = torch.zeros_like(self.param_shard)
        if master.grad is None:
            self.grad_shard.copy_(reduced)
            master.grad = self.grad_shard
        else:
            self.grad_shard.add_(reduced)

    def param_bytes(self) -> int:
        return _nbytes(self.full_param if self.full_params_live else self.param_shard)


def _nbytes(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
