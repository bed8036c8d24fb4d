"""Accelerator catalog and device-memory lookup.

Vendors sell "80GB" cards; what a training process can use is what the driver reports,
which is less (ECC, firmware and driver reservations). The catalog stores the total
capacity PyTorch reports (``torch.cuda.get_device_properties(i).total_memory``, also
printed as "GPU 0 has a total capacity of X GiB" in out-of-memory errors), in GiB
with two decimals, taken from public OOM reports where they agree. Parts without such
a report carry an approximation (nominal capacity less a typical driver reserve) and
``reported=False``; on real hardware prefer ``this-machine`` or ``--gpu-memory``. AMD's MI250X is listed per GCD (each
module appears to PyTorch as two 64 GiB devices).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace

from ..errors import EstimatorInputError
from ..byte_units import GiB, MiB, parse_bytes

THIS_MACHINE = "this-machine"


@dataclass(frozen=True)
class Device:
    """A named accelerator and the bytes one rank can address on it."""

    name: str
    memory_bytes: int
    reported: bool = True  # False: nominal capacity less the usual reserve, not a seen report
    kind: str = "cuda"     # "cpu": host RAM (no CUDA context, no caching allocator)
    generation: str = "unknown"  # GPU architecture: sizes the CUDA context (overheads.py)
    nvlink: bool = False         # NVLink/NVSwitch peers: NCCL opens more channels


def _gib(value: float) -> int:
    """GiB with two decimals → bytes, rounded to whole MiB as the driver reports."""
    return round(value * GiB / MiB) * MiB


# name: (GiB as reported, reported?, generation, NVLink)
_CATALOG_GIB: dict[str, tuple[float, bool, str, bool]] = {
    "A100-40GB": (39.50, True, "ampere", True),
    "A100-80GB": (79.25, True, "ampere", True),   # reports range 79.14–79.35 GiB across drivers
    "H100-80GB": (79.11, True, "hopper", True),
    "H100-94GB": (92.77, False, "hopper", True),  # H100 NVL
    "H100-96GB": (94.50, False, "hopper", True),  # H100 with 96 GB HBM (torchtitan's Grand Teton hosts)
    "H200": (139.81, False, "hopper", True),      # 141 GB nominal (HBM3e)
    "L4": (22.03, True, "ada", False),
    "L40S": (44.39, True, "ada", False),
    "A10": (22.00, True, "ampere", False),        # with ECC enabled, as cloud instances ship
    "A10G": (22.49, False, "ampere", False),      # AWS g5 (24 GB nominal; nvidia-smi 23028 MiB)
    "A6000": (47.50, False, "ampere", False),     # RTX A6000, 48 GB nominal
    "RTX3090": (23.69, True, "ampere", False),
    "RTX4090": (23.65, True, "ada", False),
    "TITAN-RTX": (23.65, False, "turing", False),
    "V100-16GB": (15.77, True, "volta", True),    # SXM2; nvidia-smi shows 16160 MiB in all
    "V100-32GB": (31.75, True, "volta", True),
    "T4": (14.75, True, "turing", False),
    "MI250X": (63.98, False, "cdna", True),       # per GCD
    "MI300X": (191.98, False, "cdna", True),
}
CATALOG: dict[str, Device] = {
    name: Device(name, _gib(gib), reported, generation=generation, nvlink=nvlink)
    for name, (gib, reported, generation, nvlink) in _CATALOG_GIB.items()
}


def _normalized(name: str) -> str:
    """The comparable form of a device name: case, separators, the vendor, the SXM form
    factor (the catalog's data-center parts are the SXM ones) and "GB" vs "G" forgiven."""
    key = re.sub(r"[-_ ]", "", name.lower())
    key = key.removeprefix("nvidia").removeprefix("amd")
    key = re.sub(r"sxm\d?", "", key)
    return re.sub(r"gb$", "g", key)


# Common short names -> the catalog part they usually mean (the larger-memory SXM part of a family).
_ALIASES = {"h100": "H100-80GB", "a100": "A100-80GB", "h100nvl": "H100-94GB", "mi300": "MI300X",
            "4090": "RTX4090", "3090": "RTX3090", "rtxa6000": "A6000", "h200141g": "H200"}


def catalog_lookup(name: str) -> Device | None:
    key = _normalized(name)
    key = _normalized(_ALIASES.get(key, key))
    return next((device for known, device in CATALOG.items() if _normalized(known) == key), None)


def _closest(key: str, known: list[str], n: int = 3) -> list[str]:
    """Near misses, longest shared start first (h100-40 -> the H100s before H200), then by similarity."""
    def shared_start(other: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(key, other)) if a != b), min(len(key), len(other)))
    ratio = lambda other: difflib.SequenceMatcher(None, key, other).ratio()  # noqa: E731
    candidates = [other for other in known if shared_start(other) >= 3 or ratio(other) >= 0.4]
    return sorted(candidates, key=lambda other: (-shared_start(other), -ratio(other)))[:n]


def catalog_device(name: str) -> Device:
    """Catalog lookup, forgiving case, dashes and common short names; a near miss suggests
    the closest names.

    >>> catalog_device("a100-80gb").memory_bytes, catalog_device("h100").name
    (85094039552, 'H100-80GB')
    """
    found = catalog_lookup(name)
    if found is not None:
        return found
    by_key = {_normalized(known): device for known, device in CATALOG.items()}
    close = _closest(_normalized(name), list(by_key))
    hint = f"; did you mean {', '.join(by_key[c].name for c in close)}?" if close else ""
    raise EstimatorInputError(
        f"unknown device {name!r}{hint} (see --list-devices, or give --gpu-memory)")


def this_machine() -> Device:
    """Free memory of the current CUDA device when CUDA is available, else the host RAM
    available to this rank: available RAM divided by the ranks on this machine
    (``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 without a launcher)."""
    import torch

    if torch.cuda.is_available():
        free_bytes, _total = torch.cuda.mem_get_info()
        return Device(f"{THIS_MACHINE} ({torch.cuda.get_device_name()})", int(free_bytes))
    import os

    import psutil

    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    available = int(psutil.virtual_memory().available) // local_ranks
    label = f"{THIS_MACHINE} (CPU RAM" + (f" / {local_ranks} ranks)" if local_ranks > 1 else ")")
    return Device(label, available, kind="cpu")


def resolve_device(device: str | None = None, device_memory_bytes: int | str | None = None) -> Device:
    """Pick the device: explicit memory wins, then a catalog name or "this-machine".

    ``device_memory_bytes`` accepts an int or a string with units ("24GiB", "80GB").
    """
    if device_memory_bytes is not None:
        if isinstance(device_memory_bytes, str):
            memory = parse_bytes(device_memory_bytes)
        elif isinstance(device_memory_bytes, bool) or not isinstance(device_memory_bytes, int):
            raise EstimatorInputError(f"device memory must be an int of bytes or e.g. '24GiB', got {device_memory_bytes!r}")
        else:
            memory = device_memory_bytes
        if memory <= 0:
            raise EstimatorInputError(f"device memory must be positive, got {device_memory_bytes!r}")
        known = catalog_lookup(device) if device not in (None, "cpu", THIS_MACHINE) else None
        if known is not None:
            return replace(known, memory_bytes=memory)  # keeps its generation and links
        kind = "cpu" if device == "cpu" else "cuda"
        return Device(device or "custom", memory, kind=kind)
    if device is None:
        raise EstimatorInputError("no device given; pass a catalog name, 'this-machine' or a memory size")
    if device == THIS_MACHINE:
        return this_machine()
    return catalog_device(device)
