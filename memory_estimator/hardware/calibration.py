"""Measured alpha, beta and compute rates of this machine: the file, and the fit.

``memory-estimator calibrate`` (see :mod:`memory_estimator.measure.calibrate`) or ``python -m
shardengine.selfcheck`` (which also measures the allocator's overheads on a GPU) measures and
:func:`save_calibration` stores them; the time model reads them back for
``--interconnect this-machine`` / ``--device this-machine``. Where: the path in
``$SHARDENGINE_CALIBRATION`` if set, else ``$XDG_CACHE_HOME/shardengine/calibration.json``
(``~/.cache/...`` without XDG). One file per machine: a later calibration replaces it.

>>> fit_alpha_beta([(2, 0.0, 2e-5), (2, 1e6, 1.02e-3), (2, 4e6, 4.02e-3)])
(1e-05, 1e-09)
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from ..errors import EstimatorInputError
from ..terms.overheads import Overheads

ENV_PATH = "SHARDENGINE_CALIBRATION"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """What one calibration measured, per rank, with ``world_size`` ranks running at once.

    - ``alpha_s``, ``beta_s_per_byte``: the collectives' latency per step and seconds per
      byte sent (ring-model bytes), fitted over all-reduce and all-gather timings.
    - ``matmul_flops``: a large fp32 matmul's FLOP/s (the "peak" of this device).
    - ``training_flops``: FLOP/s of forward+backward of a GPT block (6 x params x tokens);
      ``training_flops / matmul_flops`` is the default compute efficiency here.
    - ``optimizer_bytes_per_s``: AdamW's step over a flat buffer, in bytes touched per second.
    - ``overlap``: fraction of a collective hidden behind concurrent compute (0 to 1).
    - ``compute_dtype``: the dtype ``matmul_flops`` was timed in.
    - ``cuda_context_bytes``, ``fragmentation_fraction``: the allocator's overheads as measured
      on this GPU (None where not measured, e.g. on a CPU); when present they replace the
      estimator's published defaults (``calibrated_overheads``).
    """

    backend: str
    world_size: int
    alpha_s: float
    beta_s_per_byte: float
    matmul_flops: float
    training_flops: float
    optimizer_bytes_per_s: float
    overlap: float
    host: str = field(default_factory=socket.gethostname)
    torch_version: str = ""
    samples: tuple = ()           # (collective, ranks, bytes, seconds) as measured
    compute_dtype: str = "float32"
    cuda_context_bytes: Optional[int] = None
    fragmentation_fraction: Optional[float] = None

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte

    @property
    def compute_efficiency(self) -> float:
        return min(1.0, self.training_flops / self.matmul_flops)


def calibration_path() -> Path:
    """Where calibrations are stored (see the module docstring)."""
    if os.environ.get(ENV_PATH):
        return Path(os.environ[ENV_PATH])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "shardengine" / "calibration.json"


def save_calibration(calibration: Calibration, path: Path | None = None) -> Path:
    """Write atomically (a reader never sees half a file); returns the path."""
    path = Path(path) if path is not None else calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps({"format": FORMAT_VERSION, **asdict(calibration)}, indent=1))
    os.replace(temporary, path)
    return path


def load_calibration(path: Path | None = None) -> Calibration:
    """The stored calibration; a clear error when there is none or it is unreadable."""
    path = Path(path) if path is not None else calibration_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EstimatorInputError(f"no calibration of this machine at {path}: run `memory-estimator calibrate` "
                                  f"first (or set ${ENV_PATH})") from None
    except (OSError, json.JSONDecodeError) as error:
        raise EstimatorInputError(f"cannot read the calibration {path}: {error}; run "
                                  f"`memory-estimator calibrate` again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise EstimatorInputError(f"{path} is not a calibration of format {FORMAT_VERSION}; "
                                  f"run `memory-estimator calibrate` again")
    data.pop("format")
    data["samples"] = tuple(tuple(sample) for sample in data.get("samples", ()))
    try:
        calibration = Calibration(**data)
    except TypeError as error:
        raise EstimatorInputError(f"{path} is missing fields ({error}); run `memory-estimator calibrate` "
                                  f"again") from None
    rates = ("beta_s_per_byte", "matmul_flops", "training_flops", "optimizer_bytes_per_s")
    if not all(isinstance(getattr(calibration, name), (int, float)) and getattr(calibration, name) > 0
               for name in rates):
        raise EstimatorInputError(f"{path} holds a non-positive rate ({', '.join(rates)} must be > 0); run "
                                  f"`memory-estimator calibrate` again")
    return calibration


def calibrated_overheads(calibration: Union["Calibration", str, Path]) -> Optional[Overheads]:
    """The estimator's overheads with what ``calibration`` measured in place of the defaults;
    None when it measured neither (a CPU calibration), so the device's defaults stay.

    >>> c = Calibration("nccl", 1, 0.0, 1e-11, 1e14, 5e13, 1e11, 0.5, cuda_context_bytes=2**29,
    ...                 fragmentation_fraction=0.02)
    >>> calibrated_overheads(c)
    Overheads(cuda_context_bytes=536870912, fragmentation_fraction=0.02, logits_in_overhead=True, nccl_bytes=None)
    """
    if not isinstance(calibration, Calibration):
        calibration = load_calibration(Path(calibration))
    if calibration.cuda_context_bytes is None and calibration.fragmentation_fraction is None:
        return None
    defaults = Overheads()
    fragmentation = calibration.fragmentation_fraction
    return Overheads(cuda_context_bytes=calibration.cuda_context_bytes,
                     fragmentation_fraction=defaults.fragmentation_fraction if fragmentation is None else fragmentation)


def fit_alpha_beta(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) >= 0 for ``seconds = steps * alpha + bytes * beta``.

    ``points`` are (latency steps, bytes sent per rank, seconds). A negative
    coefficient (noise at tiny sizes) is clamped to 0 and the other refitted alone.
    """
    if len(points) < 2:
        raise ValueError("need at least two timings to fit alpha and beta")
    sxx = sum(s * s for s, _, _ in points)
    syy = sum(b * b for _, b, _ in points)
    sxy = sum(s * b for s, b, _ in points)
    sxt = sum(s * t for s, _, t in points)
    syt = sum(b * t for _, b, t in points)
    det = sxx * syy - sxy * sxy
    if det > 0:
        alpha, beta = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
        if alpha >= 0 and beta >= 0:
            return _round(alpha), _round(beta)
    if syy <= 0:
        raise ValueError("need timings of buffers with a positive size to fit beta")
    beta_alone = max(0.0, syt / syy)
    alpha_alone = max(0.0, sxt / sxx) if sxx else 0.0
    # Keep whichever single-coefficient fit leaves the smaller residual.
    residual = lambda a, b: sum((t - s * a - n * b) ** 2 for s, n, t in points)  # noqa: E731
    if residual(0.0, beta_alone) <= residual(alpha_alone, 0.0):
        return 0.0, _round(beta_alone)
    return _round(alpha_alone), 0.0


def _round(value: float) -> float:
    """Twelve significant digits: exact fits print as the numbers that made them."""
    return float(f"{value:.12g}")
