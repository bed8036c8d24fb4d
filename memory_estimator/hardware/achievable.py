"""What a device's kernels achieve of its data-sheet peaks: the per-operation time model's constants.

Every number here is published and none was chosen from a training run (see
``docs/time-model.md``, "Constants and their sources"):

* **Matmuls** (``MATMUL_FRACTION``): the Maximum Achievable Matmul FLOPS of a bf16
  ``torch.matmul``, mean of 100 timed calls after 50 warm-up calls, best shape found, over
  the data sheet's dense peak (S. Bekman, *Machine Learning Engineering*,
  ``compute/accelerator/README.md``, "Maximum Achievable Matmul FLOPS comparison table"):
  A100 SXM 271.2 of 312 (0.869), H100 SXM 794.5 of 989 (0.803), GH200 828.6 of 989 (0.836,
  used for the HBM3e Hoppers), MI300X 668.4 of 1300 (0.514), MI250X 147.0 of 191.5 per GCD
  (0.767). A device without a row takes ``DEFAULT_MATMUL_FRACTION``, the table's lowest
  NVIDIA figure (H100 SXM, 0.803).
* **Attention** (``ATTENTION_FRACTION``, forward and backward): the flash-attention kernel
  PyTorch's ``scaled_dot_product_attention`` dispatches to on CUDA is FlashAttention-2.
  Dao, *FlashAttention-2* (arXiv:2307.08691), abstract: "reaching 50-73% of the
  theoretical maximum FLOPs/s on A100": the forward pass reaches the upper end (0.73), the
  backward the lower (0.50; the paper's figures show backward the slower pass). On H100,
  Shah et al., *FlashAttention-3* (arXiv:2407.08608), abstract: "FlashAttention-2 achieves
  only 35% utilization on the H100 GPU": 0.35 both ways. Other devices take the A100 figures.
* **Memory-bound kernels** (``BANDWIDTH_FRACTION``): a streaming kernel reaches about 88% of
  the data sheet's HBM bandwidth (1.80 of 2.04 TB/s on an A100 80GB SXM, confirmed with
  Nsight Compute; NVIDIA's GTC 2023 talk on memory-bound kernels: about 90% at best;
  https://forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-of-a100/339083).

One constant is *not* published and is taken from runs: ``SUSTAINED_FRACTION``, per GPU
generation, the share of a measured step's compute time the operations above account for
(what they leave out: communication kernels holding SMs while they overlap, the
framework's launches and hooks, clocks under sustained power). It is the median over the
runs of the field set's ``calibration`` split on that generation (``python -m
memory_estimator.measure.field_time tests/field/throughput.json --derive``; a test checks
these values against it); the
``held-out`` split, which no constant was taken from, is what the model is judged on.
Generations without calibration runs take 1 (the mechanisms alone).

>>> achievable("A100-80GB", "ampere").matmul, achievable("H200", "hopper").attention_backward
(0.869, 0.35)
>>> achievable("RTX4090", "ada").matmul
0.803
"""
from __future__ import annotations

from dataclasses import dataclass

MATMUL_FRACTION = {"A100-40GB": 0.869, "A100-80GB": 0.869, "H100-80GB": 0.803, "H100-94GB": 0.803,
                   "H100-96GB": 0.836, "H200": 0.836, "MI300X": 0.514, "MI250X": 0.767}
DEFAULT_MATMUL_FRACTION = 0.803
# (forward, backward) achieved / peak of the flash-attention kernel, by GPU generation
ATTENTION_FRACTION = {"ampere": (0.73, 0.50), "hopper": (0.35, 0.35)}
DEFAULT_ATTENTION_FRACTION = ATTENTION_FRACTION["ampere"]
BANDWIDTH_FRACTION = 0.88
SUSTAINED_FRACTION = {"ampere": 0.85, "hopper": 0.7}


@dataclass(frozen=True)
class Achievable:
    """Achieved / data-sheet peak of each kind of kernel on one device."""

    matmul: float
    attention_forward: float
    attention_backward: float
    bandwidth: float = BANDWIDTH_FRACTION
    sustained: float = 1.0


def achievable(device_name: str, generation: str) -> Achievable:
    """The published fractions for ``device_name`` (its own MAMF row, else the default)."""
    forward, backward = ATTENTION_FRACTION.get(generation, DEFAULT_ATTENTION_FRACTION)
    return Achievable(MATMUL_FRACTION.get(device_name, DEFAULT_MATMUL_FRACTION), forward, backward,
                      sustained=SUSTAINED_FRACTION.get(generation, 1.0))
