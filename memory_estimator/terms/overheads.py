"""Memory that is neither model state nor activations: CUDA context, NCCL, the allocator.

[Note: what each measurement includes]
``torch.cuda.max_memory_allocated()`` (and "peak memory active") counts tensors only;
``max_memory_reserved()`` adds the caching allocator's unused cached blocks
(fragmentation); ``nvidia-smi`` adds the CUDA context and NCCL's buffers on top. The
plan's ``total`` is the nvidia-smi figure; ``comparable_bytes`` gives the others.

CUDA context (driver state plus the GPU kernels loaded into it):

- Before CUDA 11.7 every kernel of every library was loaded at start-up: 1,343 MiB
  on a V100 with CUDA 11.2 (Hugging Face, "Model training anatomy": nvidia-smi after
  one ``torch.ones(1).cuda()``), 1,687 MiB on an RTX 3090 with torch 1.8 + CUDA 11.1
  and 721 MiB on a GTX 1080 with CUDA 10.1 (pytorch/pytorch#55277).
- Since CUDA 11.7 kernels load lazily (torch >= 1.13 sets ``CUDA_MODULE_LOADING=LAZY``,
  pytorch/pytorch#86509: 274 MiB instead of 636 MiB after one op); the bare context
  measures 256-430 MiB (pytorch/pytorch#107667, #109888). A training step then loads its
  GEMM, attention, optimizer and NCCL kernels and cuBLAS workspaces: 512 MiB in all is
  this model's figure for every generation (``--cuda-context`` overrides it).

NCCL (NVIDIA/nccl#864, #986, #1685, maintainers' answers): memory is linear in the
number of channels and in the connections a rank opens; rings keep 2 connections at any
scale, trees a few more, and growth stops beyond two nodes. Each connection of each
channel holds the three protocols' FIFOs (``NCCL_BUFFSIZE`` = 4 MiB for Simple, plus
LL and LL128): 10 MiB per allocation in nccl#1685's log. Channels follow the link:
NVLink/NVSwitch parts open 16 or more, PCIe parts 2.

NVLink SHARP (NVLS): on Hopper parts behind NVSwitches, NCCL >= 2.17 also maps a
multicast buffer for every communicator of more than two GPUs; its log states the size
("NVLS comm ... nvlsPerRankSize 301989888 nvlsTotalSize 2415919104" for 8 H200s,
vllm-project/vllm#9699): 288 MiB per rank of the node, the whole of it backed on each GPU
(``NCCL_NVLS_ENABLE=0`` gives it back: NVIDIA/NeMo-Framework-Launcher#127, NVIDIA/JAX-Toolbox#383).
Every communicator holds its own buffers (NVIDIA/nccl#864, #964): an engine that opens a
second one over the same ranks pays twice (DeepSpeed clones the world group for its
collectives, ``deepspeed/utils/groups.py`` ``_clone_world_group``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware.devices import Device
from ..byte_units import MiB

# (lazy module loading, eager loading) context + kernels, per GPU generation.
_CONTEXT_MIB = {
    "pascal": (512, 721), "volta": (512, 1343), "turing": (512, 1343), "ampere": (512, 1687),
    "ada": (512, 1687), "hopper": (512, 1687), "cdna": (512, 1343), "unknown": (512, 1343),
}
MODULE_LOADING = ("lazy", "eager")
NCCL_BYTES_PER_CONNECTION = 10 * MiB
NCCL_MAX_CONNECTIONS = 4   # ring (2) plus tree links; no growth beyond two nodes
NVLS_BYTES_PER_NODE_RANK = 288 * MiB   # nvlsPerRankSize in NCCL's log (vllm#9699)
NODE_GPUS = 8                          # the NVSwitch baseboard's GPUs
_NO_NVSWITCH = ("H100-94GB",)          # H100 NVL: NVLink bridges between pairs, no switch


@dataclass(frozen=True)
class Overheads:
    """Memory that is neither model state nor activations, each term configurable.

    - ``cuda_context_bytes``: CUDA context and loaded kernels; None picks the device
      generation's figure (``cuda_context_for``).
    - ``fragmentation_fraction``: cached but unused allocator blocks, charged on
      everything the allocator holds at the peak. 5%.
    - ``logits_in_overhead``: count the logits and loss buffers when the vocabulary is
      known (traced estimates already include them).
    - ``nccl_bytes``: NCCL's communication buffers; None models them from the world
      size and the device's link (``nccl_buffer_bytes``), 0 on CPUs.
    """

    cuda_context_bytes: int | None = None
    fragmentation_fraction: float = 0.05
    logits_in_overhead: bool = True
    nccl_bytes: int | None = None


def cuda_context_for(device: Device, module_loading: str = "lazy") -> int:
    """Context + kernels of one process on ``device`` (0 on a CPU).

    >>> from memory_estimator.hardware.devices import catalog_device
    >>> cuda_context_for(catalog_device("V100-16GB"), "eager") // 2**20
    1343
    """
    if device.kind == "cpu":
        return 0
    lazy, eager = _CONTEXT_MIB.get(device.generation, _CONTEXT_MIB["unknown"])
    return (eager if module_loading == "eager" else lazy) * MiB


def nccl_channels(device: Device) -> int:
    return 16 if device.nvlink else 2


def nccl_buffer_bytes(device: Device, world_size: int, communicators: int = 1) -> int:
    """NCCL buffers of one rank: per communicator, channels × connections × 10 MiB, plus NVLS's
    multicast buffer on NVSwitch Hopper parts (0 for one rank or CPUs).

    >>> from memory_estimator.hardware.devices import catalog_device
    >>> nccl_buffer_bytes(catalog_device("A100-80GB"), 8) // 2**20, nccl_buffer_bytes(catalog_device("RTX4090"), 2) // 2**20
    (640, 20)
    >>> nccl_buffer_bytes(catalog_device("H100-80GB"), 8) // 2**20     # + 8 x 288 MiB of NVLS
    2944
    """
    if device.kind == "cpu" or world_size <= 1:
        return 0
    connections = min(world_size - 1, NCCL_MAX_CONNECTIONS)
    per_communicator = nccl_channels(device) * connections * NCCL_BYTES_PER_CONNECTION + nvls_bytes(device, world_size)
    return communicators * per_communicator


def nvls_bytes(device: Device, world_size: int) -> int:
    """NVLS's multicast buffer of one communicator (Hopper behind NVSwitches, more than two GPUs)."""
    if device.generation != "hopper" or not device.nvlink or device.name in _NO_NVSWITCH or world_size <= 2:
        return 0
    return NVLS_BYTES_PER_NODE_RANK * min(world_size, NODE_GPUS)


@dataclass(frozen=True)
class ResolvedOverheads:
    """The overhead terms of one estimate, in bytes (the fragmentation as a fraction)."""

    cuda_context: int
    nccl: int
    fragmentation_fraction: float
    logits: bool

    @property
    def fixed(self) -> int:
        return self.cuda_context + self.nccl


def resolve_overheads(overheads: Overheads, device: Device, world_size: int,
                      module_loading: str = "lazy", communicators: int = 1) -> ResolvedOverheads:
    context = (cuda_context_for(device, module_loading) if overheads.cuda_context_bytes is None
               else overheads.cuda_context_bytes)
    nccl = (nccl_buffer_bytes(device, world_size, communicators) if overheads.nccl_bytes is None
            else overheads.nccl_bytes)
    return ResolvedOverheads(context, nccl, overheads.fragmentation_fraction, overheads.logits_in_overhead)
