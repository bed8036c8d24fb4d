"""What a plan's total is a prediction *of*, and what varying sequence lengths add to it.

[Note: the basis of the peak]
A plan's total is the tensors alive at its peak moment (what
``torch.cuda.max_memory_allocated()`` reports), plus an allowance for the caching
allocator's cached but unused blocks (``--fragmentation``, 5%: ``max_memory_reserved()``
for steps of one shape), plus the CUDA context and NCCL's buffers, which only
``nvidia-smi`` sees (``overheads.py``). Paged optimizer states are in nvidia-smi's figure
and in neither of torch's.

[Note: segments kept for the shapes seen]
When sequence lengths vary from batch to batch (padding to each batch's longest, a
``max_seq_length`` that truncates), the caching allocator (``CUDACachingAllocator.cpp``)
serves each request over 1 MiB with the smallest cached free block that is large enough,
splitting it; freed blocks merge only with free neighbours of the same segment, and
segments are returned to the driver only by ``empty_cache()`` or after an allocation
fails, and then only those with nothing allocated in them. A step of new shapes is carved
out of the segments of the previous steps at other offsets; each of its tensors that finds
no free block large enough gets a new segment. In the worst order the whole
shape-dependent set of a step — its saved activations and its logits — lands in new
segments while the earlier ones stay cached in pieces: ``max_memory_reserved()`` and
nvidia-smi then read up to one more step's activations and logits above the total, while
``max_memory_allocated()`` stays at the longest step's. That bound is what the answer
states (:func:`variable_length_excess`); ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
maps one growing segment per stream instead and avoids most of it.

The estimate is for ``--seq-len``: with varying lengths, the cap. ``--mean-seq-len`` adds
the same estimate at a typical length (:func:`typical_length`), whose allocated peak a
typical step reaches; the reserved peak follows the longest batch seen, the cap's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from .errors import EstimatorInputError
from .units import format_bytes

if TYPE_CHECKING:
    from .request import EstimateRequest

BASIS = ("total = tensors alive at the peak (torch.cuda.max_memory_allocated) + fragmentation allowance "
         "(max_memory_reserved) + CUDA context and NCCL buffers (nvidia-smi)")


def variable_length_excess(result) -> Optional[int]:
    """Bytes of one step's saved activations and logits at ``--seq-len``: how far above the total a
    reserved / nvidia-smi reading can go when lengths vary between steps. None when the
    activations are unknown or the device has no caching allocator (host RAM)."""
    if result.activation_source == "not estimated" or result.device.kind == "cpu":
        return None
    setup = result.setup
    profile = result.model.activations(setup.micro_batch, setup)
    return int(profile.stored + result.model.logits(setup.micro_batch, setup))


def basis_note(result) -> Optional[str]:
    """The answer's line on what its totals predict (GPU devices only)."""
    if result.device.kind == "cpu":
        return None
    fraction = result.overheads.fragmentation_fraction
    note = (f"memory basis: each total is what nvidia-smi shows: the tensors alive at the peak "
            f"(torch.cuda.max_memory_allocated) + {fraction:.0%} for cached blocks (max_memory_reserved) + the "
            "CUDA context and NCCL")
    excess = variable_length_excess(result)
    if excess:
        note += (f"; if sequence lengths vary between steps, reserved and nvidia-smi can read up to "
                 f"{format_bytes(excess)} more (one step's activations and logits cached in segments of other "
                 "shapes; --mean-seq-len gives a typical step)")
    return note


def memory_basis(result) -> dict[str, Any]:
    """The JSON form: the basis, each plan's total as each reading counts it, the variable-length bound."""
    from .measure.field import METRICS, comparable_bytes

    return {"total": BASIS,
            "seq_len": result.setup.seq_len,
            "variable_length_excess_bytes": variable_length_excess(result),
            "plans": {plan.name: {metric: comparable_bytes(result, plan.name, metric) for metric in METRICS}
                      for plan in result.plans}}


# --------------------------------------------------------------------------- --mean-seq-len


def typical_length(mean: Optional[float], cap: float, estimate_at: Callable[[int], Any]):
    """The estimate at the typical length ``mean`` (None when not given) of sequences capped at
    ``cap``; ``estimate_at(seq_len)`` runs one."""
    if mean is None:
        return None
    if not (mean >= 1 and float(mean).is_integer()) or mean > cap:
        raise EstimatorInputError(f"--mean-seq-len must be a whole number of tokens from 1 to --seq-len ({cap:g}), "
                                  f"got {mean:g}")
    return estimate_at(int(mean))


def typical_json(payload: dict[str, Any], typical, result) -> dict[str, Any]:
    """``typical_length`` in the JSON: the cap's estimate stays the answer; this one beside it."""
    if typical is None:
        return payload
    plans = [{"name": plan.name, "total": plan.total, "fits": plan.fits,
              "allocated": _allocated(typical, plan.name)} for plan in typical.plans]
    return {**payload, "seq_len_basis": "cap",
            "typical_length": {"seq_len": typical.setup.seq_len, "recommended": typical.recommended,
                               "reserved_excess_bytes": variable_length_excess(typical), "plans": plans}}


def format_typical(typical, result) -> str:
    """The text lines: which basis the table is, and the typical step's totals."""
    if typical is None:
        return ""
    totals = ", ".join(f"{plan.name} {format_bytes(plan.total)}" for plan in typical.plans)
    excess = variable_length_excess(typical)
    return (f"\nsequence lengths vary: the table is for the cap, --seq-len {result.setup.seq_len}; a typical step "
            f"of {typical.setup.seq_len} tokens peaks at {totals} (recommended {typical.recommended or 'none'}); "
            "max_memory_reserved and nvidia-smi follow the longest batch seen: the table's totals"
            + (f", and up to {format_bytes(excess)} more (a typical step's activations and logits cached in "
               "segments of other shapes)" if excess else ""))


def _allocated(result, name: str) -> int:
    from .measure.field import comparable_bytes

    return comparable_bytes(result, name, "allocated")


def at_seq_len(request: "EstimateRequest") -> Callable[[int], Any]:
    """``estimate_at(seq_len)``: the same request at another sequence length."""
    from .api import estimate

    return lambda seq_len: estimate(request.replaced(seq_len=seq_len))
