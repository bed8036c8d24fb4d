"""What a plan's total is a prediction *of*, and what varying sequence lengths add to it.

[Note: the basis of the peak]
A plan's total is the tensors alive at its peak moment (what
``torch.cuda.max_memory_allocated()`` reports), plus an allowance for the caching
allocator's cached but unused blocks (``--fragmentation``, 5%: ``max_memory_reserved()``
for steps of one shape), plus the CUDA context and NCCL's buffers, which only
``nvidia-smi`` sees (``overheads.py``). Paged optimizer states are in nvidia-smi's figure
and in neither of torch's.

[Note: segments kept for the shapes seen]
When batch lengths vary (padding to each batch's longest, a ``max_length`` that
truncates or drops), the caching allocator (``CUDACachingAllocator.cpp``) keeps, per
size, the segments of every batch longer than all before it: a longer batch's tensors fit
no cached block and open new segments while the old ones stay cached, so
``max_memory_reserved()`` and nvidia-smi read more than one step at the cap, and how much
more depends on the lengths and their order; ``max_memory_allocated()`` stays at the
longest step's. The estimate replays the allocator over the run's batches
(``allocator/``: its rules from the source, a step's tensors from the activation model,
``--mean-seq-len`` or ``--length-histogram`` for the lengths, ``--steps`` for the run's
length) and counts the excess as ``cached_segments_other_lengths``, a term of every plan
(reserved and nvidia-smi, not allocated), with its range over shuffled orders;
``--expandable-segments`` replays ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
which grows one segment instead and leaves little. Without a length distribution every
batch is taken at ``--seq-len`` and the note says what varying lengths would add.

``--mean-seq-len`` also adds the same estimate at that typical length
(:func:`typical_length`), whose allocated peak a typical step reaches.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from .allocator.lengths import describe
from .errors import EstimatorInputError
from .byte_units import format_bytes

CACHED = "cached_segments_other_lengths"

if TYPE_CHECKING:
    from .request import EstimateRequest

BASIS = ("total = tensors alive at the peak (torch.cuda.max_memory_allocated) + fragmentation allowance "
         "(max_memory_reserved) + CUDA context and NCCL buffers (nvidia-smi)")


def variable_length_excess(result) -> Optional[int]:
    """Bytes the replayed allocator holds above a step at the cap (the largest over the plans),
    None when every batch is at ``--seq-len`` or the device has no caching allocator."""
    if getattr(result, "shape_cache", None) is None or result.device.kind == "cpu":
        return None
    return max((plan.buffers.get(CACHED, 0) for plan in result.plans), default=0)


def basis_note(result) -> Optional[str]:
    """The answer's line on what its totals predict (GPU devices only)."""
    if result.device.kind == "cpu":
        return None
    fraction = result.overheads.fragmentation_fraction
    note = (f"memory basis: each total is what nvidia-smi shows: the tensors alive at the peak "
            f"(torch.cuda.max_memory_allocated) + {fraction:.0%} for cached blocks (max_memory_reserved) + the "
            "CUDA context and NCCL")
    cache = getattr(result, "shape_cache", None)
    if cache is None:
        return note + ("; every batch is taken at --seq-len: if lengths vary, give --mean-seq-len or "
                       "--length-histogram (reserved then grows with the lengths seen)")
    lengths = cache.lengths
    excess = [plan.buffers.get(CACHED, 0) for plan in result.plans]
    highs = [term.high for plan in result.plans if plan.confidence is not None
             for term in plan.confidence.terms if term.term == CACHED]
    return note + (f"; {describe(lengths)}: the caching allocator replayed over them holds "
                   f"{format_bytes(max(excess))} more than a step at the cap (up to {format_bytes(max(highs or [0]))} "
                   f"over {len(cache.records)} shuffled orders{', expandable segments' if cache.expandable else ''}; "
                   "cached_segments_other_lengths)")


METRICS = ("allocated", "reserved", "nvidia-smi")  # the readings a run's peak is stated in


def comparable_bytes(result, plan_name: str, metric: str) -> int:
    """The plan's total as the run's metric counts memory."""
    plan = result.plan(plan_name)
    if metric not in METRICS:
        raise EstimatorInputError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
    fixed = plan.buffers.get("cuda_context", 0) + plan.buffers.get("nccl_buffers", 0)
    if metric == "nvidia-smi":
        return plan.total
    # paged optimizer states live outside torch's allocator: its counters never see them
    if metric == "reserved":
        return plan.total - fixed - plan.outside_allocator
    return plan.total - fixed - plan.reserved_only - plan.outside_allocator


def memory_basis(result) -> dict[str, Any]:
    """The JSON form: the basis, each plan's total as each reading counts it, the lengths and what they add."""
    cache = getattr(result, "shape_cache", None)
    lengths = None if cache is None else {
        "cap": cache.lengths.cap, "mean": cache.lengths.mean, "source": cache.lengths.source,
        "steps": cache.lengths.steps, "expandable_segments": cache.expandable,
        "records_per_shuffle": list(cache.records),
        "excess_fraction_of_step": {"low": cache.low, "median": cache.median, "high": cache.high}}
    return {"total": BASIS,
            "seq_len": result.setup.seq_len,
            "lengths": lengths,
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
                               "reserved_excess_bytes": variable_length_excess(result), "plans": plans}}


def format_typical(typical, result) -> str:
    """The text lines: which basis the table is, and the typical step's totals."""
    if typical is None:
        return ""
    totals = ", ".join(f"{plan.name} {format_bytes(plan.total)}" for plan in typical.plans)
    return (f"\nsequence lengths vary: the table is for the cap, --seq-len {result.setup.seq_len}, with the segments "
            f"the longer batches leave cached; a typical step of {typical.setup.seq_len} tokens alone peaks at "
            f"{totals} (recommended {typical.recommended or 'none'})")


def _allocated(result, name: str) -> int:
    return comparable_bytes(result, name, "allocated")


def at_seq_len(request: "EstimateRequest", estimate: Callable[["EstimateRequest"], Any]) -> Callable[[int], Any]:
    """``estimate_at(seq_len)``: the same request at another sequence length, answered by ``estimate``."""
    return lambda seq_len: estimate(request.replaced(seq_len=seq_len, mean_seq_len=None, length_histogram=None,
                                                     steps=None, over_cap="truncate"))
