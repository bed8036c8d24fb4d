"""The measurements as verdict rows: links, device rates, allocator overheads, the calibration file."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .device_rates import DeviceRates
from .links import KINDS, CollectiveTiming
from .verdict import Check

CPU_ALLOCATOR = ("not measurable on a CPU: host tensors come from malloc, with no CUDA context and no cache "
                 "of freed blocks to fragment (the estimator charges 0 on CPUs)")


def link_checks(timings: Sequence[CollectiveTiming], world: int, overlap: float) -> list[Check]:
    if not timings:
        return [Check("links", "bus bandwidth", "skip", f"world size {world}: no link to time "
                      "(launch with torchrun --nproc_per_node=2 or more)")]
    rows = []
    for kind in KINDS:
        figures = ", ".join(f"{t.full_bytes / 2**10:.0f} KiB: {t.bus_bandwidth / 1e9:.3g} GB/s "
                            f"({t.seconds * 1e3:.2f} ms)" for t in timings if t.kind == kind)
        rows.append(Check("links", f"{kind} bus bandwidth, N={world}", "info", figures))
    rows.append(Check("links", "overlap with compute", "info", f"{overlap:.2f} of an all-reduce hidden"))
    return rows


def device_checks(rates: DeviceRates) -> list[Check]:
    efficiency = rates.training_flops / rates.matmul_flops
    rows = [Check("device", f"matmul {rates.compute_dtype}", "info", f"{rates.matmul_flops / 1e9:.3g} GFLOP/s"),
            Check("device", "GPT forward+backward (fp32)", "info",
                  f"{rates.training_flops / 1e9:.3g} GFLOP/s, efficiency {efficiency:.2f} of the matmul rate"),
            Check("device", "AdamW step", "info", f"{rates.optimizer_bytes_per_s / 1e9:.3g} GB/s touched")]
    if rates.cuda_context_bytes is None:
        rows.append(Check("allocator", "CUDA context, fragmentation", "skip", CPU_ALLOCATOR))
    else:
        rows.append(Check("allocator", "CUDA context", "info", f"{rates.cuda_context_bytes / 2**20:.0f} MiB "
                          "(device bytes in use beyond the allocator's reserve)"))
        rows.append(Check("allocator", "fragmentation", "info", f"{rates.fragmentation_fraction:.1%} of the "
                          "allocated peak held reserved but unused (estimator default 5%)"))
    return rows


def calibration_checks(path: Path) -> list[Check]:
    """The file reads back, and the estimator's answer on a GPU moves by what it measured."""
    from memory_estimator import estimate
    from memory_estimator.measure import calibrated_overheads, load_calibration

    calibration = load_calibration(path)
    overheads = calibrated_overheads(calibration)
    if overheads is None:
        return [Check("calibration", str(path), "pass", "written and read back; no allocator overheads in it "
                      "(CPU): memory answers keep their defaults, time answers use it with --device/"
                      "--interconnect this-machine")]
    query = dict(params=1e9, world_size=1, device="H100-80GB", micro_batch=1, seq_len=1024)
    default, calibrated = estimate(**query).plan("ddp"), estimate(**query, calibration=path).plan("ddp")
    return [Check("calibration", str(path), "pass",
                  f"written and read back; a 1B model on an H100 at stage 0: overhead "
                  f"{default.overhead / 2**20:.0f} MiB by default, {calibrated.overhead / 2**20:.0f} MiB with it")]
