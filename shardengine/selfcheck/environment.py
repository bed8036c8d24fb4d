"""What this machine is: torch, backend, devices and their memory, NCCL, the launcher's world."""
from __future__ import annotations

import dataclasses
import os
import platform
from typing import Optional

import torch

from .verdict import Check


@dataclasses.dataclass(frozen=True)
class Environment:
    torch_version: str
    python_version: str
    cuda_version: Optional[str]
    nccl_version: Optional[str]
    backend: Optional[str]          # the process group's, None without one
    rank: int
    world_size: int
    launcher: str                   # "torchrun", "slurm" or "none"
    device: str                     # the device this rank trains on
    devices: tuple[tuple[str, int], ...]   # (name, total bytes) of every visible device (host RAM on CPU)
    cpu_threads: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _launcher() -> str:
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        return "torchrun"
    return "slurm" if "SLURM_PROCID" in os.environ else "none"


def _nccl_version() -> Optional[str]:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):  # a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _devices() -> tuple[tuple[str, int], ...]:
    if torch.cuda.is_available():
        return tuple((torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                     for i in range(torch.cuda.device_count()))
    return ((f"cpu ({platform.processor() or platform.machine()})", _host_memory_bytes()),)


def describe_environment(backend: Optional[str], rank: int, world_size: int, device: torch.device) -> Environment:
    return Environment(torch.__version__, platform.python_version(), torch.version.cuda, _nccl_version(),
                       backend, rank, world_size, _launcher(), str(device), _devices(), torch.get_num_threads())


def environment_checks(env: Environment) -> list[Check]:
    """The environment as informational rows, and a failure where a GPU is visible but unused."""
    devices = "; ".join(f"{name} {total / 2**30:.1f} GiB" for name, total in env.devices)
    checks = [Check("environment", "torch / python", "info",
                    f"torch {env.torch_version} (CUDA {env.cuda_version or '-'}, NCCL {env.nccl_version or '-'}), "
                    f"python {env.python_version}"),
              Check("environment", "world", "info",
                    f"launcher {env.launcher}, backend {env.backend or 'none'}, rank {env.rank} of {env.world_size}, "
                    f"device {env.device}, {env.cpu_threads} torch threads"),
              Check("environment", "devices", "info", devices)]
    if env.backend == "gloo" and env.cuda_version and torch.cuda.is_available():
        checks.append(Check("environment", "backend", "fail",
                            "CUDA is available but the process group is Gloo: collectives go through host "
                            "memory; launch without --backend gloo (init_distributed picks NCCL)"))
    return checks
