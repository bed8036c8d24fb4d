"""The example's memory lines: what the estimator predicted next to what this rank holds, term by term.

[Note: same basis] The estimator's total for a plan is model states (params, grads,
optimizer states) + activations + working set (the engine's transient buffers) +
overhead (CUDA context, NCCL buffers, fragmentation: none on a CPU), at the plan's
peak moment. Each is compared with a measurement of the same thing:

* model states: ``model.memory_report()``, exact bytes by category;
* activations + working set: the most bytes of tensors *created during one training
  step* (the second: the first creates the optimizer state) alive at once (activations
  saved for backward, gradients on their way into the engine's buckets, the step's
  temporaries), counted by the dispatch-mode tracker the estimator traces with, here on
  real tensors, on CPU and GPU alike. Stage 3 gathers parameters into storage it resizes
  in place, which no tensor op creates: the tracker misses them, so the engine's own
  count of its buffers is shown beside the working set;
* on CUDA also ``torch.cuda.max_memory_allocated`` against the total less the CUDA
  context, NCCL and fragmentation (which no tensor holds).

A CPU process has no comparable total: its resident memory also holds Python, torch's
libraries and the corpus, so none is printed.
"""
from __future__ import annotations

from typing import Optional

from memory_estimator.plan.memory import PlanEstimate
from shardengine.memory import MemoryReport

MB = 2**20


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MB:.2f}"


def estimate_line(plan: PlanEstimate) -> str:
    """The estimator's prediction for the plan this run uses, with the terms it holds."""
    model_states = plan.params + plan.grads + plan.optimizer_states
    return (f"estimated peak per rank for {plan.name}: {plan.total / MB:.1f} MiB at the {plan.peak_moment} = "
            f"model states {_mib(model_states)} (params {_mib(plan.params)}, grads {_mib(plan.grads)}, "
            f"optimizer states {_mib(plan.optimizer_states)}) + activations {_mib(plan.activations)} + "
            f"working set {_mib(plan.working_set)} + overhead {_mib(plan.overhead)} MiB "
            f"({'fits' if plan.fits else 'does NOT fit'}; measured at the second step)")


def check_lines(plan: PlanEstimate, report: MemoryReport, step_peak_bytes: int, rank: int, step: int,
                device_peak_bytes: Optional[int] = None) -> list[str]:
    """Measured vs estimated, one line per basis (MiB).

    ``report``: ``model.memory_report()`` right after step ``step``, before ``zero_grad()`` frees the
    gradients (not a run's first:
    that one creates the optimizer state); ``step_peak_bytes``: the tracker's peak over
    that step; ``device_peak_bytes``: ``torch.cuda.max_memory_allocated`` over it (None on CPU).
    """
    logits = plan.buffers.get("logits_and_loss", 0)
    unallocated = {"CUDA context": plan.buffers.get("cuda_context", 0), "NCCL": plan.buffers.get("nccl_buffers", 0),
                   "fragmentation": plan.buffers.get("allocator_fragmentation", 0)}
    allocated = plan.total - sum(unallocated.values())  # what tensors hold: the tracker's and CUDA's basis
    model_states = plan.params + plan.grads + plan.optimizer_states
    unseen = ("; stage 3's gathered parameters refill their storage in place, which it does not see"
              if plan.stage == 3 else "")
    lines = [
        f"memory check, rank {rank}, step {step}, MiB measured / estimated ({plan.name}):",
        f"  model states {_mib(report.model_states)} / {_mib(model_states)}: params {_mib(report.params)} / "
        f"{_mib(plan.params)}, grads {_mib(report.grads)} / {_mib(plan.grads)}, optimizer states "
        f"{_mib(report.optimizer_states)} / {_mib(plan.optimizer_states)} (measured: model.memory_report())",
        f"  step peak beyond the model states {_mib(step_peak_bytes)} / {_mib(allocated - model_states)} "
        f"(estimated: activations {_mib(plan.activations)} + working set {_mib(plan.working_set)}"
        + (f" + logits and loss {_mib(logits)}" if logits else "")
        + f"; measured: the most bytes of tensors created in the step alive at once{unseen})",
        f"  engine buffers {_mib(report.peak_comm_buffers)} / {_mib(plan.working_set)} (measured: the engine's count "
        "of its gradient buckets in flight and gathered parameters, peak since the last log line; estimated: "
        "working set)",
        f"  tensors at the peak {_mib(report.model_states + step_peak_bytes)} / {_mib(allocated)} (estimated total "
        f"{_mib(plan.total)} less " + ", ".join(f"{name} {_mib(size)}" for name, size in unallocated.items()) + ")",
    ]
    if device_peak_bytes is not None:
        lines.append(f"  CUDA max_memory_allocated {_mib(device_peak_bytes)} / {_mib(allocated)} (the same step)")
    else:
        lines.append("  (CPU: no process-wide figure compares: resident memory also holds Python, torch and the data)")
    return lines


# The categories every run has (the device's model states and their sum); the others (transient
# buffers, the host and disk tiers of offload) only where a rank holds bytes in them.
ALWAYS_SHOWN = ("params", "grads", "optimizer_states", "model_states", "total")


def table_categories(reports: list[dict[str, int]]) -> list[str]:
    """The categories of ``MemoryReport.as_dict()`` worth a row, in the report's order: those every
    run has, and the rest where any rank holds a byte in them (a run without offload shows no
    host or disk rows; one with ``offload_params=True`` shows zero device rows next to its host ones).

    >>> table_categories([{"params": 8, "grads": 0, "optimizer_states": 8, "comm_buffers": 0,
    ...                    "host_grads": 0, "host_params": 4, "model_states": 16, "total": 16}])
    ['params', 'grads', 'optimizer_states', 'host_params', 'model_states', 'total']
    """
    return [key for key in reports[0] if key in ALWAYS_SHOWN or any(report[key] for report in reports)]


def log_memory(report: MemoryReport, engine_peak_bytes: int, device_peak_bytes: Optional[int]) -> str:
    """The per-step log line's memory part, each figure labelled with what it holds."""
    text = (f"rank0 MiB model states {report.model_states / MB:.1f} (params {report.params / MB:.1f} "
            f"grads {report.grads / MB:.1f} optim {report.optimizer_states / MB:.1f}), "
            f"engine buffers peak {max(0, engine_peak_bytes - report.model_states) / MB:.1f}")
    if device_peak_bytes is not None:
        text += f", CUDA peak {device_peak_bytes / MB:.1f} (all tensors)"
    return text
