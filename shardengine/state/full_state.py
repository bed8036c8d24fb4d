"""Full (unsharded) parameter values and gradients, on request.

``full_state_dict``     full tensors under the module's own keys (collective):
                        the fp32 masters under mixed precision, bucket by bucket
                        (stage 3: one gathered bucket at a time).
``load_full_state_dict`` the reverse, with no collective: every rank holds the
                        whole dict and writes only what it keeps.
``summon_full_params``  a context in which every parameter holds its full
                        value (and optionally its full averaged gradient),
                        written back to the shards on exit.

Everything here works on the engine's flat buckets; nothing is specific to a
stage beyond "does this rank hold the whole bucket or one slice of it".
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ..errors import StateDictMismatch
from ..flat import guard
from ..flat.bucket import FlatBucket
from ..engine_api import Engine


# ---------------------------------------------------------------------------- reading


def gather_slices(engine: Engine, shard: torch.Tensor, padded_numel: int, device: torch.device) -> torch.Tensor:
    """Every rank's ``shard`` concatenated in rank order (a new tensor on ``device``)."""
    full = torch.empty(padded_numel, dtype=shard.dtype, device=device)
    engine.comm.all_gather(full, shard.to(device), async_op=False)
    return full


def bucket_values(engine: Engine, bucket: FlatBucket, training_values: bool = True) -> torch.Tensor:
    """The bucket's full flat values: its fp32 masters when they are a separate copy
    (``training_values``), else the parameters as the model computes with them.

    Collective when this rank holds only a slice (every rank must ask, in the same order).
    """
    device = bucket.full_param.device
    if training_values and bucket.master_is_separate:
        if bucket.master.numel() == bucket.layout.padded_numel:
            return bucket.master.detach()
        return gather_slices(engine, bucket.master.detach(), bucket.layout.padded_numel, device)
    if bucket.full_params_live:
        return bucket.full_param.detach()
    return gather_slices(engine, bucket.shard_values().detach(), bucket.layout.padded_numel, device)


def gathers(engine: Engine, training_values: bool = True) -> bool:
    """Whether reading every bucket's values (as :func:`bucket_values` does) is collective."""
    for bucket in engine.buckets:
        if training_values and bucket.master_is_separate:
            if bucket.master.numel() != bucket.layout.padded_numel:
                return True
        elif not bucket.full_params_live:
            return True
    return False


def bucket_grads(engine: Engine, bucket: FlatBucket) -> Optional[torch.Tensor]:
    """The bucket's full averaged gradient (after the window's normalization), or None."""
    if not bucket.requires_grad:
        return None
    if engine.spec.grads_replicated:  # stage 0: full_grad holds the reduced gradient
        return bucket.full_grad if not bucket.window_fresh else None
    shard = bucket.grad_shard if not bucket.window_fresh else None
    if shard is None:
        shard = torch.zeros(bucket.layout.shard_numel, dtype=bucket.grad_dtype, device=bucket.full_param.device)
    return gather_slices(engine, shard, bucket.layout.padded_numel, bucket.full_param.device)


def keys_by_tensor(state: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    """``id(tensor) -> its keys`` (a tied weight has several)."""
    keys: dict[int, list[str]] = {}
    for key, tensor in state.items():
        keys.setdefault(id(tensor), []).append(key)
    return keys


def full_state_dict(engine: Engine, rank0_only: bool = False, training_values: bool = True) -> dict[str, torch.Tensor]:
    """Full tensors under the module's keys; ``{}`` on ranks other than 0 with ``rank0_only``."""
    engine.failure.check_usable()
    keep = not rank0_only or engine.comm.rank == 0
    with guard.engine_access():
        state = engine.module.state_dict(keep_vars=True)
    keys_of, full = keys_by_tensor(state), {}
    for bucket in engine.buckets:
        values = bucket_values(engine, bucket, training_values)
        if not keep:
            continue
        for param, slot in zip(bucket.params, bucket.layout.slots):
            tensor = values[slot.offset:slot.end].view(slot.shape).clone()
            for key in keys_of.get(id(param), []):
                full[key] = tensor
    if not keep:
        return {}
    with guard.engine_access():
        return {key: full[key] if key in full else value.detach().clone() for key, value in state.items()}


def selected_state_dict(engine, select: Callable[[str, nn.Parameter], bool]) -> dict[str, torch.Tensor]:
    """Full values (training values) of the parameters ``select(key, param)`` picks, on every rank.

    Collective at stage 3: only the buckets holding a selected parameter are
    gathered, one at a time (a frozen base in buckets of its own is never
    materialized when only adapters are selected).
    """
    engine.failure.check_usable()
    with guard.engine_access():
        state = engine.module.state_dict(keep_vars=True)
        wanted = {id(t) for key, t in state.items() if isinstance(t, nn.Parameter) and select(key, t)}
    keys_of, out, bucketed = keys_by_tensor(state), {}, set()
    for bucket in engine.buckets:
        bucketed.update(id(p) for p in bucket.params)
        if not any(id(p) in wanted for p in bucket.params):
            continue
        values = bucket_values(engine, bucket)
        for param, slot in zip(bucket.params, bucket.layout.slots):
            if id(param) in wanted:
                tensor = values[slot.offset:slot.end].view(slot.shape).clone()
                out.update({key: tensor for key in keys_of[id(param)]})
    with guard.engine_access():  # stages 0-2 keep frozen parameters whole, outside the buckets
        out.update({key: t.detach().clone() for key, t in state.items()
                    if id(t) in wanted and id(t) not in bucketed})
    return {key: out[key] for key in state if key in out}  # the module's key order


# ---------------------------------------------------------------------------- writing


def check_state_dict(engine: Engine, state_dict: dict[str, torch.Tensor], strict: bool = True
                     ) -> tuple[list[str], list[str]]:
    """Missing and unexpected keys; raise (before any write) on a shape mismatch or, if strict, on either."""
    with guard.engine_access():
        state = engine.module.state_dict(keep_vars=True)
        shapes = {key: tuple(value.shape) for key, value in state.items() if torch.is_tensor(value)}
    missing = sorted(set(state) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(state))
    wrong = [f"{key}: {list(state_dict[key].shape)} given, {list(shape)} in the model"
             for key, shape in shapes.items() if key in state_dict and torch.is_tensor(state_dict[key])
             and tuple(state_dict[key].shape) != shape]
    problems = [f"missing keys {missing}"] if strict and missing else []
    problems += [f"unexpected keys {unexpected}"] if strict and unexpected else []
    problems += [f"shape mismatch: {'; '.join(wrong)}"] if wrong else []
    if problems:
        raise StateDictMismatch("the state dict does not match the model (nothing was loaded): "
                                + "; ".join(problems))
    return missing, unexpected


def flat_from_state(bucket: FlatBucket, state_dict, keys_of, lo: int, hi: int, dtype: torch.dtype,
                    device: torch.device) -> Optional[torch.Tensor]:
    """Flat elements ``[lo, hi)`` of ``bucket`` built from full tensors (padding zero).

    None when a parameter of the range is absent from ``state_dict`` (non-strict loading).
    """
    flat = torch.zeros(hi - lo, dtype=dtype, device=device)
    for param, slot in zip(bucket.params, bucket.layout.slots):
        a, b = max(slot.offset, lo), min(slot.end, hi)
        if a >= b:
            continue
        key = next((k for k in keys_of[id(param)] if k in state_dict), None)
        if key is None:
            return None
        source = state_dict[key].detach().reshape(-1)[a - slot.offset:b - slot.offset]
        flat[a - lo:b - lo].copy_(source)
    return flat


def write_bucket_values(bucket: FlatBucket, values: torch.Tensor, lo: int, hi: int) -> None:
    """Store full-precision values of flat ``[lo, hi)``: into the master if any, and the compute copy."""
    with torch.no_grad():
        if bucket.master is not None:
            start = 0 if bucket.master.numel() == bucket.layout.padded_numel else bucket.owned.start
            a, b = max(lo, start), min(hi, start + bucket.master.numel())
            bucket.wait_for_master_copy()  # a pinned master may still be read by a device copy
            bucket.master[a - start:b - start].copy_(values[a - lo:b - lo])
        bucket.write_compute_copy(values, lo, hi)


def load_full_state_dict(engine: Engine, state_dict: dict[str, torch.Tensor], strict: bool = True
                         ) -> tuple[list[str], list[str]]:
    """Load full tensors into this rank's shards; no collective. Returns (missing, unexpected)."""
    missing, unexpected = check_state_dict(engine, state_dict, strict)
    with guard.engine_access():
        state = engine.module.state_dict(keep_vars=True)
    keys_of = keys_by_tensor(state)
    bucketed = {id(p) for b in engine.buckets for p in b.params}
    for bucket in engine.buckets:
        lo, hi = held_range(bucket)
        dtype = bucket.master.dtype if bucket.master_is_separate else bucket.dtype
        values = flat_from_state(bucket, state_dict, keys_of, lo, hi, dtype, bucket.full_param.device)
        if values is not None:
            write_bucket_values(bucket, values, lo, hi)
    with torch.no_grad(), guard.engine_access():
        for key, tensor in state.items():
            if id(tensor) not in bucketed and key in state_dict and torch.is_tensor(tensor):
                tensor.copy_(state_dict[key])
    engine.window.note_params_written()
    return missing, unexpected


def held_range(bucket: FlatBucket) -> tuple[int, int]:
    """The flat range this rank keeps values of: the whole bucket, or its owned slice."""
    if bucket.full_params_live or (bucket.master is not None
                                   and bucket.master.numel() == bucket.layout.padded_numel):
        return 0, bucket.layout.padded_numel
    return bucket.owned.start, bucket.owned.stop


# ---------------------------------------------------------------------------- summoning


@contextlib.contextmanager
def summon_full_params(engine: Engine, writeback: bool = True, with_grads: bool = False) -> Iterator[None]:
    """Every parameter holds its full training value (and, with ``with_grads``, its full
    averaged gradient) inside the context; changes are written back on exit."""
    engine.failure.check_usable()
    if with_grads:
        engine.window.finish_gradient_sync()  # averaged, unscaled (fp16), agreed with the other ranks
    summoned = [(bucket, _own_copy(bucket, bucket_values(engine, bucket)),
                 bucket_grads(engine, bucket) if with_grads else None) for bucket in engine.buckets]
    with guard.engine_access():
        grads_before = {id(p): p.grad for b in engine.buckets for p in b.params}
    grad_guarded = [p for b in engine.buckets for p in b.params if _grad_guarded(p)]
    try:
        with engine.summoning():
            for bucket, values, grads in summoned:
                _point_at(bucket, values, grads)
            guard.set_grad_sharded(grad_guarded, False)
            yield
    finally:
        for bucket, values, grads in summoned:
            if writeback:
                lo, hi = held_range(bucket)
                write_bucket_values(bucket, values[lo:hi], lo, hi)
                if grads is not None:
                    _write_back_grads(engine, bucket, grads)
            _restore(bucket, grads_before)
        guard.set_grad_sharded(grad_guarded, True)
        if writeback:
            engine.window.note_params_written()


def _own_copy(bucket: FlatBucket, values: torch.Tensor) -> torch.Tensor:
    """``values`` if freshly gathered, else a copy (never hand out the engine's own buffers)."""
    held = [t for t in (bucket.master, bucket.full_param) if t is not None and t.untyped_storage().nbytes()]
    shared = any(values.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in held)
    return values.clone() if shared else values


def _grad_guarded(param: nn.Parameter) -> bool:
    state = guard.state_of(param)
    return state is not None and state.grad_sharded


def _point_at(bucket: FlatBucket, values: torch.Tensor, grads: Optional[torch.Tensor]) -> None:
    with guard.engine_access():
        for param, slot in zip(bucket.params, bucket.layout.slots):
            param.data = FlatBucket.slot_view(values, slot)
            guard.set_sharded(param, False)
            if grads is not None:
                param.grad = FlatBucket.slot_view(grads, slot).to(values.dtype)


def _restore(bucket: FlatBucket, grads_before: dict[int, Optional[torch.Tensor]]) -> None:
    """Parameters back into the engine's buffers (or placeholders), gradients as they were."""
    bucket.repoint_params()
    with guard.engine_access():
        for param in bucket.params:
            param.grad = grads_before[id(param)]


def _write_back_grads(engine: Engine, bucket: FlatBucket, grads: torch.Tensor) -> None:
    """Edited gradients go back where the optimizer step will read them."""
    with torch.no_grad(), guard.engine_access():
        edited = torch.cat([p.grad.reshape(-1).to(grads.dtype) for p in bucket.params])
        grads[:edited.numel()].copy_(edited)
        if engine.spec.grads_replicated:
            bucket.full_grad.copy_(grads)
        elif bucket.grad_shard is not None and not bucket.window_fresh:
            bucket.grad_shard.copy_(grads[bucket.owned])
