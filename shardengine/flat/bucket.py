"""``FlatBucket``: parameters packed into one padded flat buffer, sharded over ranks.

A bucket holds parameters that share a dtype, a device, an optimizer param
group and ``requires_grad``. Its tensors:

``full_param``   all parameters end to end, padded to a multiple of N, in the
                 compute dtype. Every parameter is re-pointed at its slice of
                 it, so the model keeps its ``nn.Parameter`` objects (identity
                 matters: tied weights, optimizers, user code). Stage 3 frees
                 its storage between uses.
``kept_shard``   this rank's slice in the compute dtype: a view into
                 ``full_param`` at stages 0-2; at stage 3 its own storage where
                 no separate master holds the values (frozen buckets, pure
                 bf16 or fp32 training: then it *is* the master), else None.
                 See [Note: no compute copy beside a master].
``master``       the flat training values the sharded optimizer steps: the
                 owned slice (the whole buffer at stage 0). It shares
                 ``full_param``'s storage in plain fp32 training; it is a
                 separate fp32 copy with mixed precision or CPU offload.
``master_pieces`` one ``nn.Parameter`` per parameter fragment of ``master``
                 (views into it): what the optimizer actually steps, so its
                 state (Adam's step count, momentum) is per parameter and a
                 parameter without a gradient is skipped exactly as torch
                 skips it. See [Note: one optimizer tensor per fragment].
``full_grad``    gradients laid out like ``full_param``, in the reduce dtype:
                 persistent at stages 0-1, transient at stages 2-3.
``grad_shard``   this rank's reduced (averaged, unscaled) gradient, accumulated
                 over micro-steps until the optimizer step consumes it.

Nothing here communicates; the stage strategies call the communicator. The
gradient half (``full_grad``, ``grad_shard``, batch-weight factors) is in
flat/bucket_grads.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .bucket_grads import BucketGradients
from .guard import engine_access, placeholder_like, set_sharded
from .layout import FlatLayout

# [Note: no compute copy beside a master]
# At stage 3 a bucket whose fp32 master is a copy of its own (mixed precision,
# optimizer offload) keeps no compute-dtype slice: that slice would always be
# exactly cast(master) (each step refreshed it from the master, each load wrote
# both), 2 bytes a parameter over N of pure redundancy. A gather instead casts
# the master into the full buffer's own chunk and all-gathers in place, as FSDP2
# casts its fp32 shard at all-gather time: casting before the wire sends the
# compute dtype (half of gathering fp32 and casting after) and the gathered
# values are bit for bit those a kept copy gave. A master on the host (offload)
# reaches the device through the same copy. Without a separate master the kept
# slice is the master (one storage), so nothing is held twice either way.
# With the parameters on the host (Offload(params=True)) that copy is the whole
# of parameter offload for a trained bucket: its only shard is the host master,
# moved to the device inside the gather (so the copy is issued with the gather's
# prefetch, before the previous unit's compute is over); a frozen bucket's kept
# slice lives on the host (``param_home``) and is moved the same way.


def host_copy(tensor: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``; in pinned memory there when it is the host and a GPU
    is present (the copy engine reads and writes only pinned pages asynchronously)."""
    copy = tensor.detach().to(device=device, dtype=dtype or tensor.dtype, copy=True)
    if copy.device.type == "cpu" and torch.cuda.is_available():
        copy = copy.pin_memory()
    return copy


@dataclass(eq=False)
class MasterPiece:
    """The part of one parameter inside a bucket's ``master``, stepped as one tensor.

    [Note: one optimizer tensor per fragment]
    A flat master spanning several parameters would share one optimizer state
    (one Adam step count, one "has a gradient" decision) among them, which is
    exact only when every parameter is updated at every step. A view per
    fragment gives each parameter's piece its own state at no memory cost,
    and torch's per-tensor optimizer loop is measured here to be no slower
    than one flat tensor (smaller tensors stay in cache).
    """

    slot: int             # index into ``bucket.params``
    param_start: int      # elements [param_start, param_end) of the flattened parameter
    param_end: int
    master_start: int     # where the piece starts in ``master``
    param: nn.Parameter   # view of master[master_start : master_start + numel]

    @property
    def master_end(self) -> int:
        return self.master_start + self.param_end - self.param_start


def point_param_at(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param`` use ``view``'s storage (and dtype), keeping the Python object."""
    if param.is_meta:
        # set_data refuses meta -> real, so first swap in an empty real tensor (keeps the
        # object's identity); set_data then gives the param its own version counter, so
        # writes into the flat buffer (stage-3 gathers) don't look like in-place edits
        # of a tensor autograd saved.
        # swap_tensors swaps the Python class and __dict__ too: put back a subclass's (a
        # bitsandbytes weight keeps its quantization settings there, flat/quantized.py).
        kind, attributes = type(param), dict(param.__dict__)
        placeholder = torch.empty(0, dtype=view.dtype, device=view.device)
        torch.utils.swap_tensors(param, nn.Parameter(placeholder, requires_grad=param.requires_grad))
        if kind is not type(param):
            param.__class__ = kind
        param.__dict__.update(attributes)
    param.data = view


class FlatBucket(BucketGradients):
    def __init__(self, params: list[nn.Parameter], group_index: Optional[int],
                 rank: int, world_size: int, device: torch.device, steps_whole: bool = False,
                 whole_tensor: bool = False, layout: Optional[FlatLayout] = None):
        """``steps_whole``: the optimizer steps the whole buffer (stage 0), not the owned slice.
        ``whole_tensor``: its optimizer needs whole parameters (optim/whole_tensor.py): the
        optimizer's tensors have the parameters' shapes, and ``layout`` (then an owner
        layout when sharded) keeps each parameter on one rank. Default: the plain layout."""
        self.params = params
        self.group_index = group_index
        self.requires_grad = params[0].requires_grad
        self.rank = rank
        self.whole_tensor = whole_tensor
        self.layout = layout or FlatLayout.build([tuple(p.shape) for p in params], world_size)
        self.owned = slice(*self.layout.owned_range(rank))
        self.step_range = slice(0, self.layout.padded_numel) if steps_whole else self.owned
        self.full_param = torch.zeros(self.layout.padded_numel, dtype=params[0].dtype, device=device)
        self.kept_shard: Optional[torch.Tensor] = self.full_param[self.owned]
        self.master: Optional[torch.Tensor] = None
        self.master_pieces: list[MasterPiece] = []
        self.master_is_separate = False
        self.master_copy_event: Optional[torch.cuda.Event] = None  # the pinned master's last async read
        self.param_home: Optional[torch.device] = None  # stage 3: where the kept slice lives (None: beside full_param)
        self.grad_dtype = self.full_param.dtype
        self.full_grad: Optional[torch.Tensor] = None
        self._unwritten: Optional[set[int]] = None  # slots of a transient full_grad not yet written
        self.grad_shard: Optional[torch.Tensor] = None
        self.grad_home: Optional[torch.device] = None
        self.window_fresh = True  # next reduced gradient starts a new accumulation
        self.carried: Optional[torch.Tensor] = None  # in no param group: stages/carried_grads.py
        self.local_factor = 1.0   # see [Note: weighted micro-steps in a persistent gradient]
        self._before_zero_weight: Optional[tuple] = None
        self._point_params(copy_values=True)

    # ------------------------------------------------------------------ parameters

    def _point_params(self, copy_values: bool = False) -> None:
        for param, slot in zip(self.params, self.layout.slots):
            view = self.slot_view(self.full_param, slot)
            if copy_values and not param.is_meta:
                view.copy_(param.detach())
            point_param_at(param, view)

    def first_param_ptr(self) -> int:
        """Where ``params[0]`` must point while the full buffer is live (not always offset 0:
        see flat/owner_layout.py)."""
        return self.full_param.data_ptr() + self.layout.slots[0].offset * self.full_param.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.full_param.dtype

    @property
    def param_nbytes(self) -> int:
        """Bytes of the full (padded) parameters, in the compute dtype."""
        return self.layout.padded_numel * self.full_param.element_size()

    @property
    def grad_nbytes(self) -> int:
        """Bytes of a full (padded) gradient, in the reduce dtype."""
        return self.layout.padded_numel * self.grad_dtype.itemsize

    def make_master(self, separate: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
        """The flat values the sharded optimizer steps (see :meth:`split_master`).

        ``separate``: an fp32 copy of its own (mixed precision, offload) instead
        of a view sharing the parameters' storage. Call before ``cast_params``.
        """
        if self.master is None:
            source = self.full_param[self.step_range].detach()
            self.master_is_separate = separate
            if separate:  # pinned on the host: fast host<->device copies each step
                source = host_copy(source, device or source.device, torch.float32)
            self.master = source
        return self.master

    def split_master(self) -> list[MasterPiece]:
        """One optimizer parameter per parameter fragment of ``master`` (views into it)."""
        pieces = []
        whole = self.step_range.stop - self.step_range.start == self.layout.padded_numel
        if whole:
            spans = [(index, 0, slot.numel, slot.offset) for index, slot in enumerate(self.layout.slots)
                     if slot.numel > 0]
        else:
            spans = [(f.slot, f.param_start, f.param_end, f.shard_start)
                     for f in self.layout.fragments(self.rank)]
        for slot, start, end, at in spans:
            view = self.master[at:at + end - start]
            if self.whole_tensor:  # whole by construction (owner layout, or stage 0)
                view = view.view(self.layout.slots[slot].shape)
            pieces.append(MasterPiece(slot, start, end, at, nn.Parameter(view, requires_grad=self.requires_grad)))
        self.master_pieces = pieces
        return pieces

    def cast_params(self, dtype: Optional[torch.dtype]) -> None:
        """Mixed precision: keep the parameters (compute copy) in ``dtype``. Only floating-point
        buckets take it: an integer parameter (a frozen index or count) keeps its dtype, as FSDP2's
        ``MixedPrecisionPolicy`` keeps it and stages 0-2 keep it outside the buckets."""
        if dtype is None or dtype == self.dtype or not self.dtype.is_floating_point:
            return
        self.full_param = self.full_param.to(dtype)
        self.kept_shard = self.full_param[self.owned]
        self._point_params()

    def copy_master_to_params(self) -> None:
        """After a step: refresh the compute copy of the stepped slice from the master."""
        if self.master_is_separate:
            target = self.full_param[self.step_range] if self.full_params_live else self.kept_shard
            if target is not None:  # None: stage 3 casts from the master at the next gather
                self._copy_from_master(target)

    def _copy_from_master(self, target: torch.Tensor) -> None:
        self._copy_from_host(target, self.master.detach())

    def _copy_from_host(self, target: torch.Tensor, source: torch.Tensor) -> None:
        # From pinned host memory the copy is queued and the host goes on (the
        # target's next reader is queued behind it on the same stream); the host
        # must not write the source again before it has been read: see
        # wait_for_master_copy ([Note: CUDA streams], distributed/streams.py).
        asynchronous = source.is_pinned() and target.device.type == "cuda"
        target.copy_(source, non_blocking=asynchronous)
        if asynchronous:
            self.master_copy_event = torch.cuda.current_stream(target.device).record_event()

    def shard_values(self) -> torch.Tensor:
        """This rank's slice in the compute dtype, on the parameters' device. Cast from the
        master when no slice is kept: then a new tensor, to read and never to write through."""
        if self.kept_shard is not None:
            return self.kept_shard.to(self.full_param.device)  # the same tensor unless on the host
        return self.master.detach().to(device=self.full_param.device, dtype=self.dtype)

    def fill_own_chunk(self) -> torch.Tensor:
        """Put this rank's slice into its chunk of the full buffer (allocated) and return that
        chunk: the input of an in-place all-gather."""
        chunk = self.full_param[self.owned]
        if self.kept_shard is None:
            self._copy_from_master(chunk)
        elif self.kept_shard.data_ptr() != chunk.data_ptr():  # stages 0-2: the chunk itself
            self._copy_from_host(chunk, self.kept_shard)
        return chunk

    def write_compute_copy(self, values: torch.Tensor, lo: int, hi: int) -> None:
        """Store flat ``[lo, hi)`` = ``values`` in the compute copy: the full buffer while it is
        live, else the kept slice's part of it (nothing where the master is the only copy)."""
        if self.full_params_live:
            self.full_param[lo:hi].copy_(values)
        elif self.kept_shard is not None:
            a, b = max(lo, self.owned.start), min(hi, self.owned.stop)
            self.kept_shard[a - self.owned.start:b - self.owned.start].copy_(values[a - lo:b - lo])

    def wait_for_master_copy(self) -> None:
        """Block the host until the last asynchronous read of the master is over (before a CPU step
        writes it)."""
        if self.master_copy_event is not None:
            self.master_copy_event.synchronize()
            self.master_copy_event = None

    def shard_params(self) -> None:
        """Stage 3: free the full buffer; keep this rank's slice only where no separate master
        holds it (see [Note: no compute copy beside a master])."""
        if self.master_is_separate:
            self.kept_shard = None
        else:
            self.kept_shard = host_copy(self.kept_shard, self.param_home or self.kept_shard.device)
            if self.master is not None:
                self.master = self.kept_shard  # plain training: the slice is the master
        self.free_full_params()

    @property
    def full_params_live(self) -> bool:
        return self.full_param.untyped_storage().nbytes() > 0

    def free_full_params(self) -> None:
        """Free the full buffer; the parameters point at placeholders (never at freed memory)."""
        with engine_access():
            for param in self.params:
                param.data = placeholder_like(param)
                set_sharded(param, True)
        self.full_param.untyped_storage().resize_(0)

    def repoint_params(self) -> None:
        """Point the parameters back at the full buffer (or placeholders when it is freed)."""
        if not self.full_params_live:
            self.free_full_params()
            return
        with engine_access():
            self._point_params()
            for param in self.params:
                set_sharded(param, False)

    def alloc_full_params(self) -> None:
        """Give the full buffer storage again and point the parameters back into it.

        Its contents are undefined until a gather (or a copy) fills them.
        """
        nbytes = self.full_param.numel() * self.full_param.element_size()
        self.full_param.untyped_storage().resize_(nbytes)
        self.repoint_params()


# The plan's buckets as they are when called: collaborators read them at each use, since the
# plan grows when the trainable set changes (stages/replan.py).
Buckets = Callable[[], list[FlatBucket]]
