"""The measurements as a calibration file the estimator reads (``memory_estimator.hardware.calibration``).

``memory-estimator --calibration FILE`` and ``estimate(..., calibration=FILE)``
then use this machine's numbers: on a GPU its measured CUDA context and
fragmentation replace the published defaults in every plan's overhead, and
``--device this-machine`` / ``--interconnect this-machine`` take their compute
rates, link latency and bandwidth from it.

The link: ``seconds = latency steps x alpha + bytes sent x beta`` fitted over
every collective timing, as ``memory-estimator calibrate`` fits it. A world of
one rank has no link to time: beta is then this device's copy rate (what a
collective of one rank would cost), and the file says so in ``samples``
(none) and ``world_size`` 1; the time model charges no communication at N = 1.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from memory_estimator.measure import Calibration, fit_alpha_beta, latency_steps, save_calibration

from .device_rates import DeviceRates
from .links import CollectiveTiming, synchronizer

# What the engine issues for each collective when a communicator uses Gloo's in-place primitives.
_IN_PLACE = {"all_gather": "broadcast", "reduce_scatter": "all_reduce"}


def link_fit(timings: Sequence[CollectiveTiming], world: int, in_place_primitives: bool) -> tuple[float, float]:
    """(alpha, beta) over the timings; beta from the largest buffers alone when noise leaves no slope."""
    issued = lambda kind: _IN_PLACE.get(kind, kind) if in_place_primitives else kind  # noqa: E731
    alpha, beta = fit_alpha_beta([(latency_steps(issued(t.kind), world), t.sent_bytes, t.seconds) for t in timings])
    if beta > 0:
        return alpha, beta
    largest = max(t.full_bytes for t in timings)
    return alpha, min(t.seconds / t.sent_bytes for t in timings if t.full_bytes == largest)


def copy_seconds_per_byte(device: torch.device, numel: int = 1 << 22) -> float:
    """A device-local copy's seconds per byte: the cost of a one-rank 'collective'."""
    sync = synchronizer(device)
    source, target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    target.copy_(source)
    sync()
    started = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    sync()
    return (time.perf_counter() - started) / (5 * numel * 4)


def build_calibration(backend: Optional[str], world: int, device: torch.device, rates: DeviceRates,
                      timings: Sequence[CollectiveTiming], in_place_primitives: bool, overlap: float) -> Calibration:
    if timings:
        alpha, beta = link_fit(timings, world, in_place_primitives)
    else:
        alpha, beta = 0.0, copy_seconds_per_byte(device)
    return Calibration(backend=backend or "none", world_size=world, alpha_s=alpha, beta_s_per_byte=beta,
                       matmul_flops=rates.matmul_flops, training_flops=rates.training_flops,
                       optimizer_bytes_per_s=rates.optimizer_bytes_per_s, overlap=overlap,
                       torch_version=torch.__version__,
                       samples=tuple((t.kind, world, t.full_bytes, t.seconds) for t in timings),
                       compute_dtype=rates.compute_dtype, cuda_context_bytes=rates.cuda_context_bytes,
                       fragmentation_fraction=rates.fragmentation_fraction)


def write_calibration(calibration: Calibration, path: Path) -> Path:
    return save_calibration(calibration, path)
