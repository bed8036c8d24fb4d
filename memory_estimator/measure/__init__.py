"""The estimator held against measurements: the only part that runs shardengine (validate,
calibrate) or reads published runs (field).

This package is also the face a measuring tool outside the estimator uses (shardengine's
``selfcheck``): the names below, each loaded on first use so that reading published runs
(``python -m memory_estimator.measure.field``) never imports the engine.

>>> from memory_estimator.measure import fit_alpha_beta
>>> alpha, beta = fit_alpha_beta([(1, 1000, 1e-3 + 1000 * 1e-9), (1, 2000, 1e-3 + 2000 * 1e-9)])
>>> round(alpha * 1e3, 6), round(beta * 1e9, 6)
(1.0, 1.0)
"""
import importlib
from typing import Any

# name -> the module that defines it
_FACE = {
    "validate": "memory_estimator.measure.validate",
    **dict.fromkeys(["Calibration", "fit_alpha_beta", "save_calibration", "load_calibration", "calibrated_overheads"],
                    "memory_estimator.hardware.calibration"),
    "latency_steps": "memory_estimator.timing.collectives",
    **dict.fromkeys(["Workload", "forward_flops", "STEP_BYTES"], "memory_estimator.timing.step"),
}
__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    home = _FACE.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(home)
    return module if home.endswith("." + name) else getattr(module, name)
