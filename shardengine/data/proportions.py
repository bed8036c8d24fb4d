"""Shares of data per rank: checking them, splitting counts by them, rebalancing them by speed.

Pure arithmetic (no process group), shared by :class:`~shardengine.data.sampler.ProportionalSampler`
and the memory estimator's per-rank batch sizes.

[Note: largest-remainder rounding]
A share p_r of n samples is rarely whole. Every rank gets the floor of its
quota p_r * n, and the samples left over go one each to the largest fractional
parts (ties to the lower rank), so counts sum to n and each is within one of
its quota. Proportions are read as the nearest fractions with denominators up
to 1e9 (0.7 as 7/10), so decimal shares round the way they read.

:func:`rebalance_proportions` turns each rank's measured time for its current
share into shares under which all ranks would take equally long
(``proportions="auto"``). Time a rank's own work (forward and backward), not
the step's wall time: waiting in collectives for slower ranks evens out wall
times and would hide the imbalance.

>>> proportional_counts(10, [.25, .25, .10, .40])
[3, 2, 1, 4]
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Sequence

from ..errors import ConfigError

SUM_TOLERANCE = 1e-6
_DENOMINATOR_LIMIT = 10 ** 9


def check_proportions(proportions: Sequence[float], num_replicas: Optional[int] = None) -> tuple[float, ...]:
    """``proportions`` as floats, or a ConfigError saying what is wrong with them."""
    if isinstance(proportions, (str, bytes)) or not hasattr(proportions, "__len__"):
        raise ConfigError(f"proportions must be a sequence of numbers, one per rank, got {proportions!r}")
    if num_replicas is not None and len(proportions) != num_replicas:
        raise ConfigError(f"proportions has {len(proportions)} entries for {num_replicas} ranks: "
                          "give one share per rank")
    values = tuple(_as_number(p, "a proportion") for p in proportions)
    bad = [(r, p) for r, p in enumerate(values) if not (math.isfinite(p) and p >= 0)]
    if bad:
        raise ConfigError(f"proportions must be finite and >= 0; rank {bad[0][0]} has {bad[0][1]}")
    if abs(sum(values) - 1) > SUM_TOLERANCE:
        raise ConfigError(f"proportions must sum to 1 (within {SUM_TOLERANCE}), got {sum(values)!r} "
                          f"for {list(values)}")
    return values


def _as_number(value, what: str) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{what} must be a number, got {value!r}") from error


def proportional_counts(total: int, proportions: Sequence[float], drop_last: bool = False) -> list[int]:
    """Split ``total`` items by ``proportions`` (largest remainder, see the Note).

    With ``drop_last`` every rank gets just the floor of its quota and the
    left-over items (fewer than the number of ranks) go to none. Also splits a
    global batch into per-rank batch sizes.

    >>> proportional_counts(64, [.7, .3]), proportional_counts(3, [.5, .5]), proportional_counts(3, [.5, .5], True)
    ([45, 19], [2, 1], [1, 1])
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ConfigError(f"total must be an int >= 0, got {total!r}")
    shares = [Fraction(p).limit_denominator(_DENOMINATOR_LIMIT)
              for p in check_proportions(proportions)]
    quotas = [share * total / sum(shares) for share in shares]
    counts = [math.floor(quota) for quota in quotas]
    if not drop_last:
        by_remainder = sorted(range(len(quotas)), key=lambda r: (counts[r] - quotas[r], r))
        for rank in by_remainder[:total - sum(counts)]:
            counts[rank] += 1
    return counts


def rebalance_proportions(proportions: Sequence[float], step_times: Optional[Sequence[float]] = None, *,
                          throughputs: Optional[Sequence[float]] = None, smoothing: float = 0.5,
                          floor: float = 0.1) -> list[float]:
    """Shares under which every rank would finish its work at the same time.

    Give either ``step_times`` (each rank's seconds of work for its share in
    ``proportions``: per step when per-rank batch sizes follow the shares, see
    :func:`proportional_counts`, else per epoch) or ``throughputs`` (samples per
    second, any common unit). A rank's speed is share / time; the balanced
    shares are proportional to speed. ``smoothing`` keeps that fraction of the old shares (measurements
    are noisy; 0 jumps straight to the balance). ``floor`` is the least share a
    rank keeps, as a fraction of an equal share 1/N, so a slow rank is still
    measured next time; ``floor=0`` lets a rank drop to 0. Measured by
    ``step_times``, a rank with share 0 did no work: speed 0, so it gets the floor.

    >>> rebalance_proportions([.5, .5], step_times=[1.0, 3.0], smoothing=0)   # rank 1 is 3x slower
    [0.75, 0.25]
    >>> rebalance_proportions([.5, .5], step_times=[1.0, 3.0])                # half way there
    [0.625, 0.375]
    """
    current = check_proportions(proportions)
    speeds = _speeds(current, step_times, throughputs)
    if not 0 <= smoothing < 1:
        raise ConfigError(f"smoothing must be in [0, 1), got {smoothing!r}")
    if not 0 <= floor <= 1:
        raise ConfigError(f"floor must be in [0, 1] (a fraction of an equal share), got {floor!r}")
    total = sum(speeds)
    mixed = [smoothing * p + (1 - smoothing) * speed / total for p, speed in zip(current, speeds)]
    return _lift_to_floor(mixed, floor / len(current))


def _speeds(current: Sequence[float], step_times, throughputs) -> list[float]:
    if (step_times is None) == (throughputs is None):
        raise ConfigError("give exactly one of step_times and throughputs")
    measured = _measurements(step_times if throughputs is None else throughputs, len(current),
                             "step_times" if throughputs is None else "throughputs")
    if throughputs is None:
        slow = [r for r, (p, t) in enumerate(zip(current, measured)) if p > 0 and t == 0]
        if slow:
            raise ConfigError(f"rank {slow[0]} has a share but a step time of 0: time its work, not a no-op")
        measured = [p / t if p > 0 else 0.0 for p, t in zip(current, measured)]
    if not sum(measured) > 0:
        raise ConfigError("no rank did measurable work: cannot rebalance")
    return measured


def _measurements(values: Sequence[float], num_replicas: int, name: str) -> list[float]:
    if len(values) != num_replicas:
        raise ConfigError(f"{name} has {len(values)} entries for {num_replicas} ranks")
    numbers = [_as_number(v, f"each of {name}") for v in values]
    if not all(math.isfinite(v) and v >= 0 for v in numbers):
        raise ConfigError(f"{name} must be finite and >= 0, got {list(values)}")
    return numbers


def _lift_to_floor(shares: list[float], floor: float) -> list[float]:
    """``shares`` (summing to 1) with every entry at least ``floor``, the mass for
    the lifted ones taken from the others in proportion to their shares."""
    if floor * len(shares) >= 1 - 1e-12:
        return [1 / len(shares)] * len(shares)
    at_floor: set[int] = set()
    while True:
        free = [r for r in range(len(shares)) if r not in at_floor]
        scale = (1 - floor * len(at_floor)) / sum(shares[r] for r in free)
        lifted = {r for r in free if shares[r] * scale < floor}
        if not lifted:
            return [floor if r in at_floor else shares[r] * scale for r in range(len(shares))]
        at_floor |= lifted
