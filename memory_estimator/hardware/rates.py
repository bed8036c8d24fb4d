"""Compute and memory rates of the catalog's accelerators, for the time model.

Peak dense FLOP/s from the vendors' data sheets (no structured sparsity): the 16-bit
tensor-core rate for bf16/fp16 training and the plain FP32 rate for fp32 (PyTorch
does not use TF32 for matmuls unless told to). Memory bandwidth is the HBM/GDDR
figure; the optimizer step is bound by it. MI250X is per GCD, as in the memory catalog.
``this-machine`` takes its rates from ``memory-estimator calibrate``.

The step's compute is the sum of its operations, each at the fraction of these peaks its
kernel is published to reach (``achievable.py``, ``timing/operations.py``);
``--compute-efficiency`` instead prices every FLOP at peak x that efficiency, and on a
calibrated machine the measured ratio of a GPT block's forward+backward to a large matmul.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .calibration import Calibration, load_calibration
from ..errors import EstimatorInputError

TFLOPS = 1e12
TB = 1e12
DEFAULT_EFFICIENCY = 0.5
# Host side of optimizer offload: a node's DRAM bandwidth shared by its ranks, and the
# PCIe link each GPU reaches it through.
HOST_MEMORY_BYTES_PER_S = 150e9
# The disk tier (shardengine's offload_optimizer="disk"): a node's local NVMe drive, shared by
# its ranks; each step reads every offloaded byte and writes it back (a PCIe 4 drive: ~3 GB/s).
DISK_BYTES_PER_S = 3e9


@dataclass(frozen=True)
class DeviceRates:
    """What one rank's device computes and moves per second."""

    name: str
    peak_flops_16bit: float
    peak_flops_fp32: float
    memory_bytes_per_s: float
    efficiency: Optional[float] = None     # None: by generation and model size (efficiency.py)
    host_link: str = "pcie4"               # the link offloaded states cross
    host_is_device: bool = False           # a CPU: "the host" is its own memory, at its own rates
    optimizer_bytes_per_s: Optional[float] = None  # measured step rate; else memory bandwidth
    generation: str = "unknown"

    def efficiency_for(self, params: Optional[float], tokens: Optional[int] = None) -> float:
        """Achieved / peak of a matmul: measured (a calibrated machine), else the device's
        published maximum achievable matmul rate x its generation's sustained fraction
        (``achievable.py``). The step's time sums its operations at their own rates
        (``timing/operations.py``); this is what its compute-bound matmuls reach.
        ``params`` and ``tokens`` are kept for the callers' signature."""
        from .achievable import achievable

        if self.efficiency is not None:
            return self.efficiency
        rates = achievable(self.name, self.generation)
        return rates.matmul * rates.sustained

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_16bit

    @property
    def step_bytes_per_s(self) -> float:
        return self.optimizer_bytes_per_s or self.memory_bytes_per_s


# name: (bf16/fp16 TFLOP/s, fp32 TFLOP/s, memory TB/s, host link)
_RATES: dict[str, tuple[float, float, float, str]] = {
    "A100-40GB": (312, 19.5, 1.555, "pcie4"),
    "A100-80GB": (312, 19.5, 2.039, "pcie4"),
    "H100-80GB": (989, 67, 3.35, "pcie5"),
    "H100-94GB": (835, 60, 3.9, "pcie5"),
    "H100-96GB": (989, 67, 3.35, "pcie5"),    # SXM5 compute with 96 GB HBM3 (Grand Teton hosts)
    "H200": (989, 67, 4.8, "pcie5"),
    "L4": (121, 30.3, 0.3, "pcie4"),
    "L40S": (362, 91.6, 0.864, "pcie4"),
    "A10": (125, 31.2, 0.6, "pcie4"),
    "A10G": (70, 35, 0.6, "pcie4"),           # AWS g5: 70 TFLOP/s dense bf16 tensor cores
    "A6000": (154.8, 38.7, 0.768, "pcie4"),   # RTX A6000
    "TITAN-RTX": (130, 16.3, 0.672, "pcie3"),  # fp16 tensor cores (no bf16)
    "RTX3090": (71, 35.6, 0.936, "pcie4"),
    "RTX4090": (165, 82.6, 1.008, "pcie4"),
    "V100-16GB": (125, 15.7, 0.9, "pcie4"),   # fp16 tensor cores (no bf16)
    "V100-32GB": (125, 15.7, 0.9, "pcie4"),
    "T4": (65, 8.1, 0.32, "pcie4"),
    "MI250X": (191.5, 23.9, 1.6, "pcie4"),
    "MI300X": (1307, 163.4, 5.3, "pcie5"),
}
def _generation(name: str) -> str:
    from .devices import CATALOG as MEMORY_CATALOG

    device = MEMORY_CATALOG.get(name)
    return device.generation if device is not None else "unknown"


CATALOG: dict[str, DeviceRates] = {
    name: DeviceRates(name, f16 * TFLOPS, f32 * TFLOPS, mem * TB, host_link=link, generation=_generation(name))
    for name, (f16, f32, mem, link) in _RATES.items()
}


def calibrated_rates(calibration: Calibration) -> DeviceRates:
    """This machine as measured: a matmul's rate is the peak (16-bit too: CPUs have no
    faster 16-bit path worth counting on), the GPT block's rate sets the efficiency. On a CPU
    (measured over Gloo) the host that offload moves to is the same memory: its step and its
    copies run at the measured rates, not a PCIe link's and a server's DRAM's."""
    return DeviceRates("this-machine", calibration.matmul_flops, calibration.matmul_flops,
                       calibration.optimizer_bytes_per_s, efficiency=calibration.compute_efficiency,
                       optimizer_bytes_per_s=calibration.optimizer_bytes_per_s,
                       host_is_device=calibration.backend == "gloo")  # calibrate runs Gloo on CPUs only


def device_rates(device_name: str, calibration: Optional[Calibration] = None,
                 peak_tflops: Optional[float] = None) -> DeviceRates:
    """Rates of a catalog device, of ``this-machine`` (calibrated), or a custom peak."""
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise EstimatorInputError(f"peak TFLOP/s must be positive, got {peak_tflops}")
        base = CATALOG.get(device_name, DeviceRates(device_name, 0, 0, 1 * TB))
        # a new peak for a known part keeps what the part is: its generation (the default
        # efficiency's curve), bandwidth and host link
        return DeviceRates(base.name, peak_tflops * TFLOPS, peak_tflops * TFLOPS, base.memory_bytes_per_s,
                           host_link=base.host_link, generation=base.generation)
    if device_name.startswith("this-machine"):
        return calibrated_rates(calibration or load_calibration())
    if device_name not in CATALOG:
        raise EstimatorInputError(f"no compute rate known for device {device_name!r}: give --peak-tflops "
                                  f"(or a catalog device, or this-machine after `memory-estimator calibrate`)")
    return CATALOG[device_name]


# Generations whose tensor cores run TF32 at half their 16-bit rate (NVIDIA's A100, H100,
# L4/L40S/RTX 4090 data sheets: 156 of 312, 494.5 of 989, 60 of 121, 82.6 of 165 TFLOP/s).
TF32_GENERATIONS = ("ampere", "ada", "hopper")


def with_tf32(rates: DeviceRates) -> DeviceRates:
    """fp32 matmuls on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32 = True`` or
    ``torch.set_float32_matmul_precision("high")``): half the 16-bit rate on the generations
    that have TF32; the others (Volta, Turing, CDNA here) keep their plain FP32 rate."""
    from dataclasses import replace

    if rates.generation not in TF32_GENERATIONS:
        return rates
    return replace(rates, peak_flops_fp32=max(rates.peak_flops_fp32, rates.peak_flops_16bit / 2))
