"""Capacity in every verdict: a plan fits when the device, the host and the disk each hold their part.

[Note: three budgets, one verdict]
An offload plan moves bytes off the device; they do not vanish. A plan "fits" only when
every place it keeps bytes has room for them:

* **device**, per rank: the plan's total at its peak against the device (``memory.py``);
* **host RAM, per node**: ranks per node x (host parameters + host gradients + host
  optimizer state + pinned staging and swap buffers (DeepSpeed's NVMe tier) + offloaded
  activations + the loader's peak while the base loads). The loader's peak is added, not
  maxed: shardengine builds its host masters in ``shard()``, before ``load_pretrained``
  streams the base in. Where the "device" is itself host RAM (CPU ranks) the ranks'
  device bytes come out of the same memory and are added too;
* **disk, per node**: ranks per node x what the plan keeps in files (the disk tier,
  DeepSpeed's NVMe offload).

The host's and the disk's capacity are per node: given (``--host-memory``,
``--disk-space``), else this machine's when the device is ``this-machine`` (RAM available
now, from psutil; free space at the offload path), else not stated. A plan that needs
host RAM or disk whose capacity is not stated does not get a plain "fits": its verdict
is "fits if" and the answer names the capacity it needs. The interpreter, torch and
the CUDA runtime in each rank's process are not counted (about 1-3 GiB per rank).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from ..errors import EstimatorInputError
from ..hardware.devices import THIS_MACHINE, Device
from ..byte_units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from .estimates import PlanEstimate

CAPACITY_VERDICTS = ("fits", "does not fit", "unknown")


@dataclass(frozen=True)
class Capacity:
    """What a node offers beside its devices: ranks, host RAM and disk (bytes; None: not stated)."""

    node_size: int = 1             # ranks a node holds: a world of N has min(N, node_size) on one node
    host_memory_bytes: Optional[int] = None
    disk_space_bytes: Optional[int] = None
    host_source: str = "not stated"
    disk_source: str = "not stated"
    device_in_host: bool = False   # CPU ranks: the "device" is this host RAM

    def ranks_per_node(self, world_size: int) -> int:
        return max(1, min(world_size, self.node_size))

    def to_json_dict(self, world_size: int) -> dict:
        return {"ranks_per_node": self.ranks_per_node(world_size), "host_memory_bytes": self.host_memory_bytes,
                "host_memory_source": self.host_source, "disk_space_bytes": self.disk_space_bytes,
                "disk_space_source": self.disk_source}

    def text(self, world_size: int) -> str:
        host = (f"{format_bytes(self.host_memory_bytes)} ({self.host_source})" if self.host_memory_bytes is not None
                else "not stated (--host-memory)")
        disk = (f"{format_bytes(self.disk_space_bytes)} ({self.disk_source})" if self.disk_space_bytes is not None
                else "not stated (--disk-space)")
        return f"{self.ranks_per_node(world_size)} rank(s) per node; host RAM {host}; disk {disk}"


def _size(name: str, value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_bytes(value, allow_zero=True)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EstimatorInputError(f"{name} must be bytes (an int >= 0) or a size such as '128GiB', got {value!r}")
    return value


def this_machine_host_bytes() -> int:
    """RAM available on this machine now (psutil): what a new job can still take."""
    import psutil

    return int(psutil.virtual_memory().available)


def this_machine_disk_bytes(path: Optional[str]) -> int:
    """Free bytes on the filesystem of ``path`` (default: the temporary directory)."""
    where = path or tempfile.gettempdir()
    if not os.path.isdir(where):
        raise EstimatorInputError(f"offload path {where!r} is not a directory")
    return int(shutil.disk_usage(where).free)


def resolve_capacity(target, device: Device, world_size: int) -> Capacity:
    """The node capacity ``target`` (a ``TargetRequest``) states, with this machine's where the
    device is ``this-machine``. Ranks per node: given, else this machine's ranks
    (``LOCAL_WORLD_SIZE``, else all), else the device's usual node (at most the world size)."""
    from ..hardware.interconnects import usual_gpus_per_node

    here = device.name.startswith(THIS_MACHINE)
    ranks = target.ranks_per_node
    if ranks is None:
        usual = None if here else usual_gpus_per_node(device.name)
        local = os.environ.get("LOCAL_WORLD_SIZE") if here else None
        ranks = int(local) if local else (usual or world_size)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise EstimatorInputError(f"ranks per node must be a whole number >= 1, got {ranks!r}")
    host, host_source = _size("host memory", target.host_memory_bytes), "given"
    if host is None and here:
        host, host_source = this_machine_host_bytes(), "this machine: RAM available now"
    disk, disk_source = _size("disk space", target.disk_space_bytes), "given"
    if disk is None and here:
        disk, disk_source = this_machine_disk_bytes(target.offload_path), \
            f"this machine: free at {target.offload_path or tempfile.gettempdir()}"
    return Capacity(ranks, host, disk, host_source if host is not None else "not stated",
                    disk_source if disk is not None else "not stated", device_in_host=device.kind == "cpu")


def _against(need: int, capacity: Optional[int]) -> str:
    if need <= 0:
        return "fits"
    if capacity is None:
        return "unknown"
    return "fits" if need <= capacity else "does not fit"


def combined_verdict(device: str, host: str, disk: str) -> str:
    """The plan's verdict over its three budgets (see [Note: three budgets, one verdict])."""
    if "does not fit" in (device, host, disk):
        return "does not fit"
    if device == "tight":
        return "tight"
    return "fits if" if "unknown" in (host, disk) else "fits"


def with_capacity(plan: "PlanEstimate", capacity: Capacity, world_size: int) -> "PlanEstimate":
    """``plan`` (its ``verdict`` the device's) with the node's host and disk judged too."""
    ranks = capacity.ranks_per_node(world_size)
    host = ranks * (plan.host_bytes + plan.load_host_peak)
    if capacity.device_in_host:
        host += ranks * plan.total
    disk = ranks * plan.disk_bytes
    host_verdict = _against(host, capacity.host_memory_bytes)
    disk_verdict = _against(disk, capacity.disk_space_bytes)
    verdict = combined_verdict(plan.device_verdict, host_verdict, disk_verdict)
    return replace(plan, host_bytes_per_node=host, disk_bytes_per_node=disk, host_verdict=host_verdict,
                   disk_verdict=disk_verdict, verdict=verdict, fits=verdict in ("fits", "fits if"),
                   host_capacity=capacity.host_memory_bytes, disk_capacity=capacity.disk_space_bytes)


def conditions(plan: "PlanEstimate") -> list[str]:
    """What a "fits if" plan needs of the node that was not stated."""
    out = []
    if plan.host_verdict == "unknown":
        out.append(f"the host has >= {format_bytes(plan.host_bytes_per_node)} of RAM per node (--host-memory)")
    if plan.disk_verdict == "unknown":
        out.append(f"the disk has >= {format_bytes(plan.disk_bytes_per_node)} free per node (--disk-space)")
    return out


def shortfalls(plan: "PlanEstimate") -> list[str]:
    """Why a plan that fits its device does not fit the node: host RAM, disk."""
    out = []
    if plan.host_verdict == "does not fit":
        out.append(f"host RAM: needs {format_bytes(plan.host_bytes_per_node)} per node, "
                   f"{format_bytes(plan.host_capacity)} available")
    if plan.disk_verdict == "does not fit":
        out.append(f"disk: needs {format_bytes(plan.disk_bytes_per_node)} per node, "
                   f"{format_bytes(plan.disk_capacity)} free")
    return out
