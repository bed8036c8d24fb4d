"""How long the batches of a run are: a cap and a distribution, stated or assumed.

[Note: the lengths a run's batches have]
A run whose sequences vary is described by its cap (``--seq-len``) and either

- ``--mean-seq-len M``: the mean *padded batch* length. Nothing else is known, so the
  lengths are taken as the distribution of greatest entropy on ``[1, cap]`` with that mean
  (a truncated exponential, uniform when ``M = (cap + 1) / 2``): an assumption, said so in
  the answer; or
- ``--length-histogram FILE``: the sequences' own lengths (a JSON object ``{"length":
  count}`` or lines ``length count``). A batch is padded to its longest sequence (dynamic
  padding, as Hugging Face's and torchtune's collators do), so a batch of ``b`` has the
  length of the longest of ``b`` draws. Sequences over the cap are truncated to it
  (``over_cap="truncate"``, tokenizers' ``truncation=True``) or left out
  (``over_cap="drop"``, e.g. ms-swift's ``truncation_strategy delete``).

``steps`` is how many micro-steps the run takes: the allocator keeps a segment for every
length longer than all before it (:mod:`.reserved`), so the reserved peak of lengths that
never reach the cap keeps growing, slowly, with the run.

>>> lengths = LengthDistribution.from_mean(700, cap=2048)
>>> round(lengths.mean)
700
>>> LengthDistribution.from_histogram({100: 3, 5000: 1}, cap=2048, micro_batch=1).lengths
(100, 2048)
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ..errors import EstimatorInputError

OVER_CAP = ("truncate", "drop")
DEFAULT_STEPS = 1000
_SUPPORT_POINTS = 256   # the max-entropy distribution is tabulated on this many lengths


@dataclass(frozen=True)
class LengthDistribution:
    """Batch lengths (after padding) and their probabilities, plus how they were obtained."""

    cap: int
    lengths: tuple[int, ...]            # ascending
    weights: tuple[float, ...]          # probabilities, summing to 1
    source: str                         # "histogram" (stated) or "mean" (assumed shape)
    steps: int = DEFAULT_STEPS

    @property
    def mean(self) -> float:
        return sum(length * weight for length, weight in zip(self.lengths, self.weights))

    @property
    def assumed(self) -> bool:
        return self.source != "histogram"

    @property
    def reaches_cap(self) -> float:
        """The probability that a batch has the cap's length (sequences truncated to it)."""
        return sum(w for length, w in zip(self.lengths, self.weights) if length == self.cap)

    def sample(self, rng: random.Random, count: int) -> list[int]:
        return rng.choices(self.lengths, cum_weights=_cumulative(self.weights), k=count)

    def with_steps(self, steps: int) -> "LengthDistribution":
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise EstimatorInputError(f"--steps must be a whole number of micro-steps >= 1, got {steps!r}")
        return LengthDistribution(self.cap, self.lengths, self.weights, self.source, steps)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_mean(cls, mean: float, cap: int, steps: int = DEFAULT_STEPS) -> "LengthDistribution":
        """The greatest-entropy distribution of batch lengths on ``[1, cap]`` with this mean."""
        if not (isinstance(mean, (int, float)) and 1 <= mean <= cap and float(mean).is_integer()):
            raise EstimatorInputError(f"--mean-seq-len must be a whole number of tokens from 1 to --seq-len ({cap:g}), "
                                      f"got {mean:g}" if isinstance(mean, (int, float)) else f"got {mean!r}")
        points = sorted({max(1, round(1 + (cap - 1) * i / (_SUPPORT_POINTS - 1))) for i in range(_SUPPORT_POINTS)})
        rate = _rate_for_mean(points, float(mean))
        top = max(rate * x for x in points)
        weights = [math.exp(rate * x - top) for x in points]
        total = sum(weights)
        return cls(cap, tuple(points), tuple(w / total for w in weights), "mean").with_steps(steps)

    @classmethod
    def from_histogram(cls, counts: Mapping[int, float], cap: int, micro_batch: int, over_cap: str = "truncate",
                       steps: int = DEFAULT_STEPS) -> "LengthDistribution":
        """Sequence lengths and their counts (keys may be strings, as JSON has them); batches of
        ``micro_batch`` padded to their longest."""
        if over_cap not in OVER_CAP:
            raise EstimatorInputError(f"--over-cap must be one of {', '.join(OVER_CAP)}, got {over_cap!r}")
        kept: dict[int, float] = {}
        for key, count in counts.items():
            length = _whole(key)
            if length is None or length < 1 or not isinstance(count, (int, float)) or not count >= 0:
                raise EstimatorInputError(f"a length histogram maps lengths >= 1 to counts >= 0, got {key!r}: "
                                          f"{count!r}")
            if length > cap and over_cap == "drop":
                continue
            kept[min(length, cap)] = kept.get(min(length, cap), 0.0) + float(count)
        total = sum(kept.values())
        if total <= 0:
            raise EstimatorInputError(f"the length histogram has no sequence of at most --seq-len {cap} tokens")
        lengths = sorted(kept)
        single = [kept[length] / total for length in lengths]
        below = list(_cumulative(single))
        # P(longest of b <= x) = F(x)^b: the padded batch length's distribution
        batch = [below[i] ** micro_batch - (below[i - 1] ** micro_batch if i else 0.0) for i in range(len(lengths))]
        return cls(cap, tuple(lengths), tuple(batch), "histogram").with_steps(steps)


def run_lengths(training, micro_batch: int) -> Optional[LengthDistribution]:
    """The batch lengths a ``TrainingRequest`` states (None: every batch at ``seq_len``)."""
    mean, histogram = training.mean_seq_len, training.length_histogram
    steps = DEFAULT_STEPS if training.steps is None else training.steps
    if mean is not None and histogram is not None:
        raise EstimatorInputError("give --mean-seq-len or --length-histogram, not both (the histogram has a mean)")
    if mean is not None:
        if isinstance(mean, bool) or not isinstance(mean, (int, float)):
            raise EstimatorInputError(f"--mean-seq-len must be a number of tokens, got {mean!r}")
        return LengthDistribution.from_mean(mean, training.seq_len, steps)
    if histogram is None:
        if training.steps is not None or training.over_cap != "truncate":
            raise EstimatorInputError("--steps and --over-cap describe varying lengths: give --mean-seq-len or "
                                      "--length-histogram too")
        return None
    counts = histogram if isinstance(histogram, Mapping) else read_histogram(histogram)
    return LengthDistribution.from_histogram(counts, training.seq_len, micro_batch, training.over_cap, steps)


def read_histogram(path: str | Path) -> dict[int, float]:
    """A histogram file: JSON ``{"length": count, ...}`` or lines ``length count`` (``#`` comments)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise EstimatorInputError(f"cannot read the length histogram {path}: {error.strerror}") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        loaded = None
    pairs = loaded.items() if isinstance(loaded, dict) else _lines(text, path)
    try:
        return {length: float(count) for length, count in pairs}
    except (TypeError, ValueError):
        raise EstimatorInputError(f"{path}: a length histogram maps whole lengths to counts") from None


def _lines(text: str, path) -> list[tuple[str, str]]:
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.replace(",", " ").split()
        if len(fields) != 2:
            raise EstimatorInputError(f"{path}:{number}: expected 'length count', got {line!r}")
        pairs.append((fields[0], fields[1]))
    return pairs


def _whole(key) -> Optional[int]:
    if isinstance(key, bool):
        return None
    try:
        value = float(key)
    except (TypeError, ValueError):
        return None
    return int(value) if value.is_integer() else None


def _cumulative(weights) -> tuple[float, ...]:
    running, out = 0.0, []
    for weight in weights:
        running += weight
        out.append(running)
    return tuple(out)


def _rate_for_mean(points: list[int], mean: float) -> float:
    """The exponent ``r`` of ``p(x) ∝ exp(r·x)`` on ``points`` whose mean is ``mean`` (bisection)."""
    span = points[-1] - points[0] or 1

    def mean_at(rate: float) -> float:
        top = max(rate * x for x in points)
        weights = [math.exp(rate * x - top) for x in points]
        return sum(w * x for w, x in zip(weights, points)) / sum(weights)

    low, high = -200.0 / span, 200.0 / span
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if mean_at(middle) < mean else (low, middle)
    return (low + high) / 2


def describe(lengths: Optional[LengthDistribution]) -> str:
    if lengths is None:
        return "every batch at the cap"
    how = ("stated by a histogram" if lengths.source == "histogram"
           else "of greatest entropy for the stated mean (assumed shape)")
    return f"batch lengths up to {lengths.cap}, mean {lengths.mean:.0f}, {how}, over {lengths.steps} micro-steps"
