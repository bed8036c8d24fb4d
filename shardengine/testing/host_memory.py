"""The process's host memory as the operating system counts it: resident now, and its high-water mark.

What the load-time measurements of the fine-tuning tests and benchmark read.
The high-water mark never goes down, so it is read after each phase (build,
load, first step) to give the peak up to the end of that phase; subtract the
resident size measured before the first phase to leave out the interpreter
and its imports.

>>> peak_rss_bytes() >= rss_bytes() > 0
True
"""

from __future__ import annotations

import gc
import resource
import sys


def rss_bytes() -> int:
    """Resident set size now (Linux ``VmRSS``); the high-water mark where that is not readable."""
    return _status_bytes("VmRSS") or peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's resident set high-water mark (Linux ``VmHWM``, else ``ru_maxrss``)."""
    peak = _status_bytes("VmHWM")
    if peak:
        return peak
    kilo = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux kilobytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kilo


def reset_peak_rss() -> None:
    """Lower this process's high-water mark to its resident size now (Linux: ``5`` to
    /proc/self/clear_refs), so that a later peak is one phase's, as in a fresh process.
    Raises ``OSError`` where the kernel does not allow it (see :func:`peak_rss_resets`)."""
    gc.collect()  # the previous measurement's objects and reference cycles
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_rss_resets() -> bool:
    """Whether :func:`reset_peak_rss` works here (Linux >= 4.0 lets a process reset its own)."""
    try:
        reset_peak_rss()
    except OSError:
        return False
    return peak_rss_bytes() <= rss_bytes() + 2**20


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
