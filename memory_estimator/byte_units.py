"""Byte quantities: parsing "24GiB" / "80GB" and printing them back.

Vendors quote decimal GB (1e9) while allocators report binary GiB (2**30); both are
accepted, and the unit letters decide which one is meant.
"""
from __future__ import annotations

import re

from .errors import EstimatorInputError

GB = 10**9
GiB = 2**30
MiB = 2**20

_UNIT_BYTES = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # Bare "k"/"m"/"g"/"t" are read as binary, as nvidia-smi and ulimit do.
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, *, allow_zero: bool = False, require_unit: bool = False) -> int:
    """Parse a memory size such as ``"24GiB"``, ``"80GB"``, ``"1.5e9"`` into bytes.

    Sizes of devices must be positive; an overhead may be ``allow_zero`` ("0" means none).
    ``require_unit`` refuses a bare number other than 0 (the command line's flags: "24"
    would be 24 bytes, never what was meant); ``24B`` says bytes.

    >>> parse_bytes("24GiB"), parse_bytes("80GB"), parse_bytes("1024"), parse_bytes("0", allow_zero=True)
    (25769803776, 80000000000, 1024, 0)
    """
    match = _SIZE_PATTERN.match(str(text))
    if not match:
        raise EstimatorInputError(f"cannot read memory size {text!r}; write e.g. 24GiB, 80GB or 1.5e9")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNIT_BYTES:
        raise EstimatorInputError(
            f"unknown memory unit {match.group(2)!r} in {text!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    if number < 0:
        raise EstimatorInputError(f"memory size must {'not be negative' if allow_zero else 'be positive'}, "
                                  f"got {text!r}")
    if require_unit and not unit and number != 0:
        bare = match.group(1)
        raise EstimatorInputError(f"memory size {text!r} has no unit (it would mean {bare} bytes); write "
                                  f"{bare}GiB (binary, as torch and nvidia-smi report), {bare}GB (decimal) "
                                  f"or {bare}B for bytes")
    size = int(round(number * _UNIT_BYTES[unit]))
    if size == 0 and not allow_zero:
        raise EstimatorInputError(f"memory size must be positive, got {text!r}")
    return size


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if value >= scale:
            return f"{sign}{value / scale:.2f} {unit}"
    return f"{sign}{int(value)} B"
