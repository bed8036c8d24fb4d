"""Each plan's terms with their basis and range (``confidence.py``), from what ``plan_estimate`` priced."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping

from ..byte_units import format_bytes
from .confidence import PlanConfidence, TermConfidence

if TYPE_CHECKING:
    from ..engines.base import EngineTerms
    from ..terms.overheads import ResolvedOverheads
    from .inputs import MemoryInputs

_ORDER_UNBOUNDED = ("the batches come longest-last (each longer than all before it): reserved then grows to the "
                    "device, where the allocator frees its cache and retries (slower steps)")


@dataclass(frozen=True)
class Cached:
    """Segments held beside the peak's tensors, by name, at the answer's point and its ends."""

    point: Mapping[str, int]
    low: Mapping[str, int]
    high: Mapping[str, int]
    unbounded_above: bool = False       # the replayed high end was cut at the device's memory


@dataclass(frozen=True)
class PlanParts:
    """What ``plan_estimate`` priced, handed over to be assessed."""

    terms: "EngineTerms"
    moment: str
    activations: int
    logits: int
    buffers: Mapping[str, int]
    overheads: "ResolvedOverheads"
    outside: int
    total: int
    cached: Cached = field(default_factory=lambda: Cached({}, {}, {}))
    logits_cast_rise: int = 0           # what an unstated logits cast adds to the high end (memory.py)


def plan_confidence(parts: PlanParts, inputs: "MemoryInputs") -> PlanConfidence:
    """The plan's terms, each with its basis and range, the total's range and what is unbounded."""
    terms = list(_state_terms(parts, inputs)) + [_activation_term(parts, inputs), _working_set_term(parts)]
    terms += list(_overhead_terms(parts, inputs))
    low = parts.total - sum(t.bytes - t.low for t in terms)
    high = parts.total + sum(t.high - t.bytes for t in terms)
    unbounded, turns_on = [], []
    if inputs.model.source == "not estimated" and not inputs.model.unmodelled:
        unbounded.append("the activations (not estimated: give the model's shapes) exceed the headroom")
    unbounded += [f"{part} exceed the headroom" for part in inputs.model.unmodelled]
    if inputs.shape_cache is not None and inputs.device.kind != "cpu":
        unbounded.append(_ORDER_UNBOUNDED)
        if inputs.shape_cache.lengths.assumed:
            turns_on.append("the lengths' distribution, assumed from their mean (--length-histogram states it)")
    if parts.cached.unbounded_above:
        turns_on.append("the allocator freeing its cache and retrying once reserved reaches the device")
    for term in terms:
        if term.term == "logits_and_loss" and term.low != term.high:
            turns_on.append(_logits_turns_on(parts, term))
    offset = parts.overheads.cuda_context + parts.overheads.nccl
    return PlanConfidence(tuple(terms), low, high, tuple(unbounded), tuple(turns_on), offset)


def _state_terms(parts: PlanParts, inputs: "MemoryInputs"):
    exact = (inputs.exact is not None and inputs.exact.applies(inputs.setup.world_size)
             and inputs.engine.name == "shardengine")
    basis = "exact" if exact else "modelled"
    why = ("shardengine's layout of this module (its bucket planner, padding included)" if exact
           else f"{inputs.engine.name}'s buffers as its source allocates them (engines/{inputs.engine.name}.py)")
    grads = parts.terms.grads if parts.moment == "step" or not parts.terms.grads_transient else 0
    for name, value in (("params", parts.terms.params), ("grads", grads),
                        ("optimizer_states", parts.terms.optimizer_states)):
        yield TermConfidence(name, basis, value, value, value, why)


def _activation_term(parts: PlanParts, inputs: "MemoryInputs") -> TermConfidence:
    source = inputs.model.source
    if source == "not estimated":
        return TermConfidence("activations", "assumption", 0, 0, 0, "not estimated: counted as 0")
    why = ("traced on fake tensors" if source == "traced"
           else "tensor by tensor from the model's shapes (terms/activations.py)")
    if inputs.model.unmodelled:
        why += "; not counted (unbounded): " + "; ".join(inputs.model.unmodelled)
    return TermConfidence("activations", "modelled", parts.activations, parts.activations, parts.activations, why)


def _working_set_term(parts: PlanParts) -> TermConfidence:
    named = sum(size for name, size in parts.buffers.items() if name not in _OVERHEAD_NAMES)
    return TermConfidence("working_set", "modelled", named, named, named,
                          "the engine's named buffers at the peak moment (engines/)")


_OVERHEAD_NAMES = ("cuda_context", "nccl_buffers", "logits_and_loss", "allocator_fragmentation",
                   "cached_segments_other_lengths", "cached_step_segments")


def _overhead_terms(parts: PlanParts, inputs: "MemoryInputs"):
    overheads, buffers = parts.overheads, parts.buffers
    if "cuda_context" in buffers:
        stated = inputs.overheads.cuda_context_bytes is not None
        yield TermConfidence("cuda_context", "modelled", overheads.cuda_context, overheads.cuda_context,
                             overheads.cuda_context, "stated or calibrated" if stated
                             else "published figure for the GPU generation (terms/overheads.py)")
    if "nccl_buffers" in buffers:
        yield _nccl_term(overheads.nccl, inputs)
    if parts.logits or parts.logits_cast_rise:
        yield _logits_term(parts, inputs)
    fragmentation = buffers.get("allocator_fragmentation", 0)
    if fragmentation:
        yield TermConfidence("allocator_fragmentation", "assumption", fragmentation, fragmentation, fragmentation,
                             f"{overheads.fragmentation_fraction:.0%} of what the allocator holds, for steps of one "
                             "shape (published default, or calibrated)")
    for name, point in parts.cached.point.items():
        lengths = inputs.shape_cache.lengths if inputs.shape_cache is not None else None
        assumed = name == "cached_segments_other_lengths" and lengths is not None and lengths.assumed
        why = ("the run's batch lengths replayed through the caching allocator (allocator/reserved.py)"
               if name == "cached_segments_other_lengths"
               else "the engine's step buffers, in segments its forward tensors are not carved from")
        yield TermConfidence(name, "assumption" if assumed else "modelled", point, parts.cached.low[name],
                             parts.cached.high[name], why)


def _nccl_term(nccl: int, inputs: "MemoryInputs") -> TermConfidence:
    """NCCL's FIFOs are modelled; NVLS's multicast buffer depends on the NCCL version and
    ``NCCL_NVLS_ENABLE``: the range runs from without it to with it."""
    from ..terms.overheads import nvls_bytes

    why = "channels x connections x FIFOs per communicator (terms/overheads.py)"
    if inputs.overheads.nccl_bytes is not None:
        return TermConfidence("nccl_buffers", "modelled", nccl, nccl, nccl, "stated")
    nvls = nvls_bytes(inputs.device, inputs.setup.world_size) * getattr(inputs.engine, "communicators", 1)
    if not nvls:
        return TermConfidence("nccl_buffers", "modelled", nccl, nccl, nccl, why)
    return TermConfidence("nccl_buffers", "assumption", nccl, nccl - nvls, nccl,
                          why + "; with NVLS's multicast buffers (NCCL >= 2.17 on NVSwitch Hopper; "
                          "NCCL_NVLS_ENABLE=0 gives them back)")


_CAST_WHY = ("the in-place loss's {c}-byte logits (terms/kernels.py); Unsloth's forward casts them to the "
             "checkpoint's config.torch_dtype, {dtype} bytes here: transformers >= 4.50 sets it to the dtype the "
             "model is loaded in (no copy: the point and the low end), transformers < 4.50 leaves config.json's "
             "(a copy beside the logits, in forward and again in backward: the high end, with what it adds to "
             "fragmentation and to the other lengths' cached segments)")


def _logits_turns_on(parts: PlanParts, term: TermConfidence) -> str:
    if parts.logits_cast_rise:
        return (f"the transformers version: before 4.50 Unsloth's forward casts the logits to config.json's wider "
                f"torch_dtype (logits and loss {format_bytes(term.high)}, with what the copy adds to the cached "
                f"segments), from 4.50 on it does not ({format_bytes(term.low)})")
    return (f"whether the loss upcasts the 16-bit logits to fp32 ({format_bytes(term.high)}) or not "
            f"({format_bytes(term.low)}): --loss-upcast / --no-loss-upcast")


def _logits_term(parts: PlanParts, inputs: "MemoryInputs") -> TermConfidence:
    setup, model = inputs.setup, inputs.model
    ranged = (setup.loss == "plain" and setup.loss_upcast is None and setup.policy.activation_bytes == 2
              and setup.policy.amp is None)
    if parts.logits_cast_rise:
        return TermConfidence("logits_and_loss", "assumption", parts.logits, parts.logits,
                              parts.logits + parts.logits_cast_rise, _CAST_WHY.format(
                                  dtype=model.architecture.checkpoint_bytes, c=setup.policy.activation_bytes))
    if not ranged:
        return TermConfidence("logits_and_loss", "modelled", parts.logits, parts.logits, parts.logits,
                              f"{setup.loss} cross-entropy's buffers (terms/kernels.py)")
    without = model.logits(setup.micro_batch, replace(setup, loss_upcast=False))
    return TermConfidence("logits_and_loss", "assumption", parts.logits, min(without, parts.logits), parts.logits,
                          "a plain loss over 16-bit logits: with an fp32 upcast (Hugging Face's loss) or without "
                          "(a criterion on the logits themselves); not stated")
