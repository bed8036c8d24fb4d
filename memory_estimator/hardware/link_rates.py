"""Links stated by number: ``200GB/s``, ``400Gb/s/node``, ``50GB/s,2us``; and ``--p2p off``.

[Note: a link by its rate]
A link the catalog has no name for (export-market NVLink at 200 GB/s per direction, a
two-card NVLink bridge at ~50 GB/s, 400 Gb/s shared by an 8-GPU node) is given by its
nominal rate per direction: a number, a unit (``GB/s``, ``Gb/s``, ``MB/s``, ``TB/s``; bytes
and bits are told apart by the ``B``), and optionally whose it is: ``/gpu`` (the default:
what one rank can push) or ``/node`` (shared by the node's GPUs, divided by
``--gpus-per-node``), then ``,<latency>`` (``2us``, ``0.5ms``; default 1 µs inside a node,
5 µs between nodes, the catalog's figures for NVLink/PCIe and InfiniBand). Like the catalog
links it is nominal: collectives reach ``CATALOG_EFFICIENCY`` (80%) of it as bus bandwidth.

``--p2p off`` (NCCL_P2P_DISABLE=1, or GPUs with no peer-to-peer path) sends intra-node
traffic through host memory (NCCL's SHM transport): every byte crosses the GPUs' link
twice, device to host and host to device, so the link carries half its rate, and each
message step pays the two copies' latency.

>>> link = rate_link("400Gb/s/node", role="inter", gpus_per_node=8)
>>> link.nominal_bytes_per_s / 1e9, link.latency_s
(6.25, 5e-06)
>>> host_staged(rate_link("32GB/s", role="intra")).nominal_bytes_per_s / 1e9
16.0
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Optional

from ..errors import EstimatorInputError
from .link import Link

_UNITS = {"TB/s": 1e12, "GB/s": 1e9, "MB/s": 1e6, "Tb/s": 1e12 / 8, "Gb/s": 1e9 / 8, "Mb/s": 1e6 / 8,
          "TBps": 1e12, "GBps": 1e9, "MBps": 1e6, "Tbps": 1e12 / 8, "Gbps": 1e9 / 8, "Mbps": 1e6 / 8}
_LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_DEFAULT_LATENCY = {"intra": 1e-6, "inter": 5e-6}
_PATTERN = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>[TGM]B/s|[TGM]b/s|[TGM]Bps|[TGM]bps)"
                      r"\s*(?:(?:/|\s+per\s+)(?P<whose>gpu|node))?"
                      r"\s*(?:,\s*(?P<latency>\d+(?:\.\d+)?)\s*(?P<lunit>ns|us|µs|ms|s))?\s*$", re.IGNORECASE)
P2P = ("on", "off")


def looks_like_rate(text: str) -> bool:
    """Whether a link name is a stated rate (digits first) rather than a catalog name."""
    return bool(text) and text.strip()[:1].isdigit()


def rate_link(text: str, role: str = "intra", gpus_per_node: Optional[int] = None) -> Link:
    """The :class:`Link` a stated rate describes (``role`` "intra" or "inter" picks its default latency)."""
    match = _PATTERN.match(text)
    if match is None or match.group("unit") is None or _unit(match.group("unit")) is None:
        raise EstimatorInputError(f"link {text!r}: give a catalog name or a rate such as 200GB/s, 400Gb/s/node or "
                                  "50GB/s,2us (B: bytes, b: bits; /gpu or /node; ,latency)")
    value = float(match.group("value")) * _unit(match.group("unit"))
    whose = (match.group("whose") or "gpu").lower()
    if whose == "node":
        if not gpus_per_node:
            raise EstimatorInputError(f"link {text!r} is per node: give --gpus-per-node to divide it")
        value /= gpus_per_node
    latency = _DEFAULT_LATENCY[role] if match.group("latency") is None else (
        float(match.group("latency")) * _LATENCY_UNITS[match.group("lunit").lower().replace("µs", "us")])
    if value <= 0:
        raise EstimatorInputError(f"link {text!r}: the rate must be above zero")
    shared = f", {text.strip()} shared by {gpus_per_node} GPUs" if whose == "node" else ""
    return Link(text.strip(), value, latency, description=f"stated rate{shared}: {value / 1e9:.4g} GB/s per GPU "
                                                                 f"per direction, {latency * 1e6:.3g} µs")


def host_staged(link: Link) -> Link:
    """The intra-node link with peer-to-peer off: through host memory, half the rate, two copies' latency."""
    return replace(link, name=f"{link.name} (p2p off)", nominal_bytes_per_s=link.nominal_bytes_per_s / 2,
                   latency_s=2 * link.latency_s,
                   description=f"{link.description or link.name}, peer-to-peer off: staged through host memory")


def check_p2p(value: str) -> bool:
    """``--p2p on|off`` as a bool (True: peer-to-peer)."""
    if value not in P2P:
        raise EstimatorInputError(f"--p2p must be on or off, got {value!r}")
    return value == "on"


def _unit(unit: str) -> Optional[float]:
    """Bytes and bits differ by the ``B``'s case; the prefix and ``/s`` may be any case."""
    for known, scale in _UNITS.items():
        if unit[0].upper() == known[0] and unit[1] == known[1] and unit[2:].lower() == known[2:].lower():
            return scale
    return None
