"""What the estimator needs to know about a model, whatever the input was."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import EstimatorInputError

# Above this many parameters an input is treated as a typo (1e9 vs 1e19), not a model.
MAX_PLAUSIBLE_PARAMS = 10**14


@dataclass(frozen=True)
class Architecture:
    """Transformer facts the activation formula needs (Korthikanti et al. 2022 notation)."""

    layers: int   # L
    hidden: int   # h
    heads: int    # a
    vocab: int    # V, for the logits/loss buffers


@dataclass(frozen=True)
class ModelStats:
    """Unique parameter count plus the facts that size activations and the stage-3 working set.

    ``largest_unit`` is the parameter count of the biggest piece stage 3 gathers at once
    (one transformer block, or the embedding if larger); None when unknown.
    ``factored_state_numel`` is Adafactor's factored second moment: rows + cols for each
    matrix, numel for each vector.
    """

    params: int
    largest_unit: int | None = None
    architecture: Architecture | None = None
    factored_state_numel: int = 0
    source: str = "params"


def factored_numel(shape: Sequence[int]) -> int:
    """Elements of Adafactor's second-moment state for one tensor of this shape."""
    if len(shape) < 2:
        return math.prod(shape)
    return shape[0] + math.prod(shape[1:])


def factored_numel_of(shapes: Iterable[Sequence[int]]) -> int:
    return sum(factored_numel(shape) for shape in shapes)


def check_count(name: str, value: object, *, minimum: int = 1, maximum: int = MAX_PLAUSIBLE_PARAMS) -> int:
    """Validate a whole-number input (accepts 7e9 written as a float) and return it as int."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EstimatorInputError(f"{name} must be a number, got {value!r}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise EstimatorInputError(f"{name} must be a whole number, got {value!r}")
    number = int(value)
    if number < minimum:
        raise EstimatorInputError(f"{name} must be at least {minimum}, got {number}")
    if number > maximum:
        raise EstimatorInputError(f"{name} = {number:.3g} is implausibly large (limit {maximum:.0e}); check the exponent")
    return number


def stats_from_count(
    params: int | float,
    *,
    largest_unit: int | float | None = None,
    architecture: Architecture | None = None,
) -> ModelStats:
    """ModelStats for a bare parameter count such as ``7e9``.

    Without ``largest_unit`` but with an architecture, the unit is the larger of one
    GPT block (12h² + 13h: QKV, output, 4h MLP, biases, two LayerNorms) and the
    V×h embedding.
    """
    count = check_count("params", params)
    unit = None if largest_unit is None else check_count("largest layer", largest_unit, maximum=count)
    if unit is None and architecture is not None:
        h = architecture.hidden
        unit = min(count, max(12 * h * h + 13 * h, architecture.vocab * h))
    return ModelStats(params=count, largest_unit=unit, architecture=architecture, source="params")
