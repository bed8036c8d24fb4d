"""Link classes for the time model: per-rank bandwidth and per-step latency, with a catalog.

A training cluster has two link classes: inside a node (NVLink, PCIe) and between
nodes (InfiniBand, Ethernet). Each is one :class:`Link`: the bandwidth one rank can
push in one direction, and alpha, the latency of one message step of a collective.

Bandwidths are the nominal per-GPU, per-direction figures: NVLink 3 (A100, 12 links x
25 GB/s) 300 GB/s, NVLink 4 (H100 SXM, 18 links) 450 GB/s, PCIe 3.0 x16 16 GB/s, PCIe 4.0 x16 32 GB/s,
PCIe 5.0 x16 64 GB/s, InfiniBand HDR 200 Gb/s = 25 GB/s and NDR 400 Gb/s = 50 GB/s per
NIC, 100 and 400 Gigabit Ethernet 12.5 and 50 GB/s. Inter-node figures assume one
NIC per GPU (rail-optimised DGX/HGX nodes); with fewer NICs divide accordingly.
Collective libraries reach ~80% of nominal as bus bandwidth (nccl-tests on DGX
systems), so catalog links carry ``efficiency=0.8``. Latencies are order-of-magnitude
per step (NVLink ~1 µs, PCIe ~2 µs, InfiniBand ~5 µs, RoCE ~8 µs, TCP ~25 µs);
``memory-estimator calibrate`` measures both for the machine it runs on
(``this-machine``).

>>> resolve_link("IB-NDR").bandwidth_bytes_per_s / 1e9
40.0
"""
from __future__ import annotations

import difflib
from typing import Optional

from .calibration import Calibration, load_calibration
from .link import CATALOG_EFFICIENCY, Link  # noqa: F401 - CATALOG_EFFICIENCY: re-exported
from .link_rates import looks_like_rate, rate_link
from ..errors import EstimatorInputError

THIS_MACHINE = "this-machine"


GB = 1e9
CATALOG: dict[str, Link] = {link.name: link for link in (
    Link("nvlink3", 300 * GB, 1e-6, description="NVLink 3 (A100 SXM), intra-node"),
    Link("nvlink4", 450 * GB, 1e-6, description="NVLink 4 (H100 SXM), intra-node"),
    Link("pcie3", 16 * GB, 2e-6, description="PCIe 3.0 x16 (TITAN RTX, V100 hosts), intra-node"),
    Link("pcie4", 32 * GB, 2e-6, description="PCIe 4.0 x16, intra-node"),
    Link("pcie5", 64 * GB, 2e-6, description="PCIe 5.0 x16, intra-node"),
    Link("ib-hdr", 25 * GB, 5e-6, description="InfiniBand HDR 200 Gb/s, one NIC per GPU"),
    Link("ib-ndr", 50 * GB, 5e-6, description="InfiniBand NDR 400 Gb/s, one NIC per GPU"),
    Link("100gbe", 12.5 * GB, 25e-6, description="100 Gigabit Ethernet (TCP), one NIC per GPU"),
    Link("400gbe", 50 * GB, 8e-6, description="400 Gigabit Ethernet (RoCE), one NIC per GPU"),
)}

# The intra-node link a device usually comes with (SXM parts: NVLink; the rest: PCIe).
_DEFAULT_INTRA = {"A100-40GB": "nvlink3", "A100-80GB": "nvlink3", "H100-80GB": "nvlink4", "H200": "nvlink4",
                  "H100-94GB": "pcie5", "H100-96GB": "nvlink4", "A10G": "pcie4", "A6000": "pcie4", "TITAN-RTX": "pcie4", "L40S": "pcie4", "L4": "pcie4", "A10": "pcie4", "RTX3090": "pcie4",
                  "RTX4090": "pcie4", "V100-16GB": "pcie4", "V100-32GB": "pcie4", "T4": "pcie4"}


# GPUs in the usual node of a device, when only the total is given: 8 on the HGX/DGX and OAM
# baseboards of the data-center parts (A100, H100, H200, V100 SXM; MI300X; MI250X: 4 modules,
# 8 GCDs) and in the usual PCIe servers of L4/L40S/A10/T4; 4 in workstations of the others.
DEFAULT_GPUS_PER_NODE = 8
_WORKSTATION_GPUS_PER_NODE = {"RTX3090": 4, "RTX4090": 4, "TITAN-RTX": 4, "A6000": 4}


def usual_gpus_per_node(device_name: str) -> Optional[int]:
    """GPUs per node assumed for a device; None for ``this-machine`` (its ranks share this host)."""
    if device_name.startswith(THIS_MACHINE):
        return None
    return _WORKSTATION_GPUS_PER_NODE.get(device_name, DEFAULT_GPUS_PER_NODE)


def calibrated_link(calibration: Calibration) -> Link:
    """This machine's measured link: efficiency 1 (already achieved), measured overlap."""
    return Link(THIS_MACHINE, calibration.bandwidth_bytes_per_s, calibration.alpha_s, efficiency=1.0,
                description=f"measured by `memory-estimator calibrate` ({calibration.backend}, "
                            f"{calibration.world_size} ranks on {calibration.host})",
                backend=calibration.backend, overlap=calibration.overlap)


def _key(name: str) -> str:
    return name.replace("-", "").replace("_", "").replace(" ", "").lower()


def resolve_link(name: str, calibration: Optional[Calibration] = None, role: str = "intra",
                 gpus_per_node: Optional[int] = None) -> Link:
    """A catalog link by name (case and dashes forgiven), ``this-machine`` (the calibration), or a
    stated rate such as ``200GB/s`` or ``400Gb/s/node`` (``link_rates.py``; ``role`` "intra" or
    "inter" sets its default latency, ``gpus_per_node`` divides a per-node rate).

    A near miss suggests the closest names.
    """
    if _key(name) == _key(THIS_MACHINE):
        return calibrated_link(calibration or load_calibration())
    by_key = {_key(known): link for known, link in CATALOG.items()}
    if _key(name) in by_key:
        return by_key[_key(name)]
    if looks_like_rate(name):
        return rate_link(name, role, gpus_per_node)
    close = difflib.get_close_matches(_key(name), list(by_key), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(by_key[c].name for c in close)}?" if close else ""
    raise EstimatorInputError(f"unknown interconnect {name!r}{hint} (known: {', '.join(CATALOG)}, {THIS_MACHINE}, "
                              "or a rate such as 200GB/s or 400Gb/s/node)")


def default_intra_node(device_name: str) -> str:
    """The intra-node link assumed for a catalog device when none is given."""
    if device_name.startswith(THIS_MACHINE):
        return THIS_MACHINE
    return _DEFAULT_INTRA.get(device_name, "pcie4")
