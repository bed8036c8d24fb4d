"""One plan's answer: its per-rank bytes term by term, where they live, and its verdicts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from .confidence import PlanConfidence

# "fits if": the device holds it, and the node's host RAM or disk it needs was not stated (capacity.py)
VERDICTS = ("fits", "tight", "fits if", "does not fit")
# Buffers the caching allocator holds that no tensor occupies: reserved and nvidia-smi see them,
# max_memory_allocated does not.
RESERVED_ONLY = ("allocator_fragmentation", "cached_segments_other_lengths", "cached_step_segments")


@dataclass(frozen=True)
class PlanEstimate:
    """One plan's per-rank bytes at its peak moment, term by term, and its verdict."""

    name: str
    stage: int
    offload: bool
    params: int
    grads: int
    optimizer_states: int
    activations: int
    working_set: int
    overhead: int
    fits: bool
    headroom: int                    # usable bytes left over; negative when it does not fit
    host_optimizer_states: int = 0   # optimizer states (incl. master) held in CPU RAM
    host_params: int = 0             # parameter shards held in CPU RAM (zero3-offload-params)
    host_grads: int = 0              # reduced gradient shards held in CPU RAM (zero3-offload-params)
    host_bytes: int = 0              # everything this plan keeps in host RAM, per rank
    disk_bytes: int = 0              # what it keeps in files (the disk tier), per rank
    disk_params: int = 0             # ... of which parameter shards (zero3-offload-params-disk)
    peak_moment: str = "forward"     # "forward", "head fetch", "recompute" or "step"
    verdict: str = "fits"            # over device, host and disk: "fits", "tight", "fits if" or "does not fit"
    buffers: Mapping[str, int] = field(default_factory=dict)   # the named working set and overheads
    moments: Mapping[str, int] = field(default_factory=dict)   # total at each candidate moment
    outside_allocator: int = 0       # device bytes torch's allocator does not see (paged optimizer states)
    load_host_peak: int = 0          # adapters: host bytes per rank while the base loads (finetune.py)
    # [Note: three budgets, one verdict] (capacity.py): the device's verdict alone, and the node's
    device_verdict: str = "fits"     # "fits", "tight" (inside the margin) or "does not fit"
    host_activations: int = 0        # saved activations offloaded to host RAM, per rank (in host_bytes)
    kept_activations: int = 0        # traced modules: the most kept for backward on the device, as
                                     # memory_report().peak_activations measures it (in activations)
    host_bytes_per_node: int = 0     # ranks per node x (host_bytes + load_host_peak), + the ranks' device
                                     # bytes where the device is host RAM
    disk_bytes_per_node: int = 0
    host_verdict: str = "fits"       # "fits", "does not fit" or "unknown" (needs host RAM, none stated)
    disk_verdict: str = "fits"
    host_capacity: int | None = None  # the node's, as stated (None: not stated)
    disk_capacity: int | None = None
    confidence: "PlanConfidence | None" = None   # per term: exact / modelled / assumption, and the range

    @property
    def reserved_only(self) -> int:
        """Bytes the allocator caches beside the peak's tensors (in reserved, not in allocated)."""
        return sum(self.buffers.get(name, 0) for name in RESERVED_ONLY)

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer_states + self.activations
                + self.working_set + self.overhead)

    def to_json_dict(self) -> dict:
        terms = ("params", "grads", "optimizer_states", "activations", "working_set", "overhead")
        per_rank = {term: int(getattr(self, term)) for term in terms}
        per_rank["total"] = int(self.total)
        return {"name": self.name, "stage": self.stage, "offload": self.offload,
                "per_rank_bytes": per_rank, "fits": self.fits, "verdict": self.verdict,
                "peak_moment": self.peak_moment, "host_bytes": int(self.host_bytes),
                **({"disk_bytes": int(self.disk_bytes)} if self.disk_bytes else {}),
                "outside_allocator_bytes": int(self.outside_allocator),
                "device_verdict": self.device_verdict, "host_verdict": self.host_verdict,
                "disk_verdict": self.disk_verdict, "host_bytes_per_node": int(self.host_bytes_per_node),
                "disk_bytes_per_node": int(self.disk_bytes_per_node),
                **({"host_activation_bytes": int(self.host_activations)} if self.host_activations else {}),
                **({"kept_activation_bytes": int(self.kept_activations)} if self.kept_activations else {}),
                "buffers": {name: int(size) for name, size in self.buffers.items()},
                **({"load_host_peak_bytes": int(self.load_host_peak)} if self.load_host_peak else {}),
                **({"confidence": self.confidence.to_json_dict()} if self.confidence is not None else {})}
