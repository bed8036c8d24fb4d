"""A traced module's activations unit by unit, so checkpointing and offload are priced from one trace.

[Note: what a checkpointed or offloaded unit keeps, from one trace]
The trace (``module.py``) runs one forward and backward on fake tensors. Beside its peak it
records, for each stage-3 unit (the engine's own ``find_units``: the blocks of a
``ModuleList``, a ``wrap`` class), through ``saved_tensors_hooks`` and the tracker:

* ``saved``: the bytes of the storages first saved for backward while the unit ran (a
  storage counts once, for the first unit that saves it; parameters are not traced);
* ``inputs``: the unit's input storages (what ``torch.utils.checkpoint`` keeps of a unit);
* ``matmuls`` and ``attention``: every matmul's and attention kernel's output storage made in
  the unit, in order, saved or not (what selective checkpointing's "save the matmuls" policy,
  torch's ``create_selective_checkpoint_contexts``, caches for backward);
* the peak of live bytes in each phase of the step: the forward of each unit, the stretch
  after it (the next unit, or the head and the loss after the last), the backward of each
  unit (from the gradient of its output to that of the unit before).

A checkpointed unit keeps (``checkpointing.py``'s vocabulary): ``full`` (every unit, or units
0, K, 2K, ... with ``every-k:K``) its inputs; ``selective:mm`` its inputs, every matmul output
and the attention outputs; ``selective:mm/2`` (``selective:op``) every other matmul output
instead; ``none`` and ``selective`` (a fused attention keeps no scores) everything. What a
unit drops is absent from every phase until its own backward, which recomputes it: a
phase's peak under a policy is the traced one less what the units before it dropped (so
the recomputation costs what the unit held, at its own backward, and the loss's buffers
and one unit's recomputation are never counted together). Offload moves what each unit
keeps to pinned host memory as forward saves it: in each phase all but the two most recent
units' (the one whose copy is in flight, the one prefetched ahead of its backward) are on
the host. The step's peak is the largest phase; all of it scales with the micro-batch.

[Note: what is kept for backward, as the engine counts it]
Beside the live bytes, each phase records the most bytes *kept for backward* while it ran:
what the saved-tensor hooks hold, counted by the engine's own ``ActivationLedger`` (each
storage once, parameters never, from the save to autograd's release), so that this figure
and ``memory_report().peak_activations`` are the same measurement, one on fake tensors, one
on the run. The same pricing applies (what earlier units dropped or moved is subtracted
phase by phase): :meth:`TracedActivations.profile`'s ``kept`` and ``kept_host``. The live
peak also holds temporaries (gradients of activations, the loss's buffers) that nothing
keeps for backward; it decides whether a plan fits, ``kept`` is what checkpointing and
offload act on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..terms.activations import ActivationProfile
from shardengine.engine_facts import ActivationLedger, copied_to_host, is_parameter, offloaded_blocks

from ..terms.checkpointing import parse_policy

# aten ops whose outputs selective checkpointing's "save the matmuls" policy keeps
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_int_mm"})
ATTENTION_OPS = frozenset({"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
                           "_flash_attention_forward", "_efficient_attention_forward"})
OUTSIDE = -1


@dataclass(frozen=True)
class UnitTrace:
    """One unit's activation storages at the traced micro-batch (see the note above)."""

    saved: int
    inputs: int
    matmuls: tuple[int, ...] = ()
    attention: int = 0
    host_copies: int = 0  # bytes of the saved views offload copies to the host (offload.py's rules)

    def kept(self, kind: str, stride: int = 1, offset: int = 0) -> int:
        """Bytes this unit keeps for backward when checkpointed with a policy of ``kind``."""
        if kind == "mm":
            return self.inputs + sum(self.matmuls[offset::stride]) + self.attention
        return self.inputs


@dataclass(frozen=True)
class TracedActivations:
    """One trace's peak, its units and its phases' peaks, priced under any policy and offload.

    ``phases``: (kind, unit, peak live bytes) with kind ``"before"`` (ahead of the first
    unit), ``"forward"``, ``"after"`` (after that unit's forward) or ``"backward"``."""

    peak: int
    micro_batch: int
    units: tuple[UnitTrace, ...] = ()
    phases: tuple[tuple[str, int, int], ...] = ()
    kept_phases: tuple[tuple[str, int, int], ...] = ()  # the same phases' bytes kept for backward
    # every saved storage of a unit: (the unit that first saved it, bytes, each save as (unit,
    # whether offload can copy that view)); empty for traces made before these were recorded
    storages: tuple[tuple[int, int, tuple[tuple[int, bool], ...]], ...] = ()
    copies_in_flight: int = 1  # finished units whose host copy may still run (0 off CUDA: copies are plain)

    def profile(self, checkpointing: str, offload: bool, micro_batch: int) -> ActivationProfile:
        """The device's activation peak and what offload keeps on the host, at ``micro_batch``
        (every activation has the batch as a dimension)."""
        scale = micro_batch / self.micro_batch
        policy = parse_policy(checkpointing)
        checkpointed = self._checkpointed(policy)
        kept = [unit.kept(policy.kind, policy.mm_stride, policy.mm_offset) if i in checkpointed else unit.saved
                for i, unit in enumerate(self.units)]
        dropped = [unit.saved - keep for unit, keep in zip(self.units, kept)]
        # the engine's rule of which units offload moves (the last never: backward needs it first)
        offloaded = offloaded_blocks(bool(offload), len(kept))
        moved, copied = self._moved(kept, checkpointed, policy.kind, offloaded)
        peak = _priced(self.phases, dropped, (moved, copied), self.peak, self.copies_in_flight)
        kept_peak = _priced(self.kept_phases, dropped, (moved, copied), 0, self.copies_in_flight)
        return ActivationProfile(math.ceil(peak * scale), host=math.ceil(sum(copied) * scale),
                                 kept=math.ceil(kept_peak * scale), kept_host=math.ceil(sum(copied) * scale))

    def _moved(self, kept: list[int], checkpointed: set[int], kind: str,
               offloaded: list[bool]) -> tuple[list[int], list[int]]:
        """Per unit: the device bytes offload frees, and the bytes its host copies take.

        A checkpointed unit's saved tensors are what its checkpoint keeps (a selective region's
        cached matmul outputs are held by torch's own cache and stay: activations/offload.py).
        Another unit's are priced save by save where the trace recorded them: a storage leaves
        the device only when every save of it was copied (a view offload skips, too small or
        not dense, or a save in a unit not offloaded keeps it there), and each copied view
        takes its own bytes on the host."""
        movable = [unit.inputs if i in checkpointed and kind == "mm" else keep
                   for i, (unit, keep) in enumerate(zip(self.units, kept))]
        moved = [size if moves else 0 for size, moves in zip(movable, offloaded)]
        copied = list(moved)
        if not self.storages:
            return moved, copied
        plain = [i for i in range(len(self.units)) if i not in checkpointed]
        for i in plain:
            moved[i] = 0
            copied[i] = self.units[i].host_copies if offloaded[i] else 0
        for owner, size, saves in self.storages:
            if owner in plain and all(unit >= 0 and offloaded[unit] and (copies or unit in checkpointed)
                                      for unit, copies in saves):
                moved[owner] += size
        return moved, copied

    def _checkpointed(self, policy) -> set[int]:
        if policy.kind in ("none", "selective"):
            return set()
        return set(range(0, len(self.units), policy.every))


def _priced(phases: tuple[tuple[str, int, int], ...], dropped: list[int], moved: tuple[list[int], list[int]],
            default: int, in_flight: int) -> int:
    """The largest phase once what earlier units dropped (checkpointing) or moved (offload:
    ``moved`` is the device bytes each unit frees and the bytes of its copies) is taken off;
    ``default`` where the trace has no phases. Of the units whose forward finished, the last
    ``in_flight`` may still be copying out; in backward the running unit and the one below it
    are back on the device as copies (prefetched one ahead)."""
    freed, copied = moved
    peak = default if not phases else 0
    for kind, unit, size in phases:
        done = unit + 1 if kind == "after" else unit
        on_device = 1 if kind == "backward" else in_flight
        size -= sum(dropped[:done]) + sum(freed[:max(0, done - on_device)])
        if kind == "backward":
            size += sum(copied[u] - freed[u] for u in range(max(0, unit - 1), unit + 1))
        peak = max(peak, size)
    return max(peak, 0)


class UnitRecorder:
    """Records, during one traced forward and backward, what :class:`TracedActivations` holds.

    ``tracked(key)`` says whether a storage was created inside the trace (the tracker's own
    bookkeeping: parameters and the example inputs are not activations)."""

    def __init__(self, find_units: Callable[[nn.Module], list[nn.Module]], micro_batch: int) -> None:
        self._find_units = find_units
        self._micro_batch = micro_batch
        self._current: Optional[int] = None
        self._phase: tuple[str, int] = ("before", 0)
        self._phase_peaks: dict[tuple[str, int], int] = {}
        self._kept = ActivationLedger()          # what the saved-tensor hooks hold (the Note)
        self._saves: dict[int, list[tuple[int, bool]]] = {}     # storage -> its saves (unit, copied)
        self._copies: dict[int, dict[tuple, int]] = {}          # unit -> {view: bytes} offload copies
        self.copies_in_flight = 1
        self._kept_peaks: dict[tuple[str, int], int] = {}
        self._count = 0
        self._owner: dict[int, int] = {}         # storage -> the unit that first saved it
        self._bytes: dict[int, int] = {}
        self._inputs: dict[int, dict[int, int]] = {}   # unit -> {storage: bytes}
        self._matmuls: dict[int, list[tuple[int, int]]] = {}
        self._attention: dict[int, dict[int, int]] = {}
        self.tracked: Callable[[int], bool] = lambda key: True

    def attach(self, module: nn.Module) -> list[Any]:
        """Forward hooks on ``module``'s units; returns their handles."""
        units = self._find_units(module)
        self._count = len(units)
        handles = []
        for index, unit in enumerate(units):
            handles.append(unit.register_forward_pre_hook(self._enter(index), with_kwargs=True))
            handles.append(unit.register_forward_hook(self._leave(index), always_call=True))
        return handles

    def _enter(self, index: int):
        def hook(_module, args, kwargs):
            if not torch.is_grad_enabled():
                return None
            self._enter_phase(("forward", index))
            self._current = index
            seen = self._inputs.setdefault(index, {})
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    storage = value.untyped_storage()
                    if self.tracked(id(storage)):  # an activation, not an example input
                        seen[id(storage)] = storage.nbytes()
            return None
        return hook

    def _leave(self, index: int):
        def hook(_module, _args, output):
            if self._current != index:
                return None
            self._current = None
            self._enter_phase(("after", index))
            grads = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads:  # its backward starts with its output's gradient
                grads[0].register_hook(self._backward(index))
            return None
        return hook

    def _backward(self, index: int):
        def hook(_grad):
            self._enter_phase(("backward", index))
        return hook

    def _enter_phase(self, phase: tuple[str, int]) -> None:
        self._phase = phase
        self._note_kept()

    def _note_kept(self) -> None:
        kept = self._kept.device.current
        if kept > self._kept_peaks.get(self._phase, -1):
            self._kept_peaks[self._phase] = kept

    def on_live(self, live: int) -> None:
        """The tracker's live bytes after an allocation: the running phase's peak."""
        if live > self._phase_peaks.get(self._phase, -1):
            self._phase_peaks[self._phase] = live

    def pack(self, tensor: torch.Tensor) -> Any:
        """``saved_tensors_hooks``' pack: attribute the storage to the running unit, and hold it
        in the ledger until autograd lets the saved tensor go (:meth:`unpack`'s pair)."""
        if not isinstance(tensor, torch.Tensor) or is_parameter(tensor):
            return tensor, None
        if not in_backward():
            storage = tensor.untyped_storage()
            key = id(storage)
            unit = OUTSIDE if self._current is None else self._current
            if key not in self._owner and self.tracked(key):
                self._owner[key] = unit
                self._bytes[key] = storage.nbytes()
            copies = copied_to_host(tensor)
            self._saves.setdefault(key, []).append((unit, copies))
            if copies and unit != OUTSIDE:
                view = (key, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype)
                self._copies.setdefault(unit, {})[view] = tensor.numel() * tensor.element_size()
        token = self._kept.keep(tensor)
        self._note_kept()
        return tensor, token

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed[0]

    def on_output(self, name: str, key: int, size: int) -> None:
        """The tracker saw op ``name`` create storage ``key``: note a unit's matmul outputs."""
        if self._current is None or in_backward():
            return
        if name in MATMUL_OPS:
            self._matmuls.setdefault(self._current, []).append((key, size))
        elif name in ATTENTION_OPS:
            self._attention.setdefault(self._current, {})[key] = size

    def result(self, peak: int) -> TracedActivations:
        units = []
        for index in range(self._count):
            saved = sum(size for key, size in self._bytes.items() if self._owner[key] == index)
            inputs = sum(size for key, size in self._inputs.get(index, {}).items()
                         if self._owner.get(key, index) == index)
            matmuls = tuple(size for key, size in dict(self._matmuls.get(index, ())).items()
                            if key not in self._inputs.get(index, {}))
            units.append(UnitTrace(saved, inputs, matmuls, sum(self._attention.get(index, {}).values()),
                                   sum(self._copies.get(index, {}).values())))
        phases = tuple((kind, unit, live) for (kind, unit), live in self._phase_peaks.items())
        kept = tuple((kind, unit, size) for (kind, unit), size in self._kept_peaks.items())
        storages = tuple((owner, self._bytes[key], tuple(self._saves.get(key, ())))
                         for key, owner in self._owner.items() if owner != OUTSIDE)
        return TracedActivations(peak, self._micro_batch, tuple(units), phases, kept, storages,
                                 self.copies_in_flight)


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1
