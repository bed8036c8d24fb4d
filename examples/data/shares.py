"""Uneven data for the example: each rank's batches in proportion to its share, and shares that follow speed.

A step always covers the same *global* micro-batch (``--micro-batch`` x ranks);
rank r takes ``proportional_counts(global, shares)[r]`` sequences of it, drawn
by ``se.data.ProportionalSampler`` from non-overlapping windows of the corpus. The
engine weights each rank's gradient by its batch size, so the update is the
mean over the global batch whatever the shares are.

``--proportions auto``: :class:`ShareTuner` times each rank's own work
(forward and backward, minus the time spent waiting in collectives), agrees on
the measurements over all ranks and re-balances with ``se.data.rebalance_proportions``
so that every rank's work takes equally long.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

import shardengine as se
from shardengine.distributed.launch import all_gather_object_default_group
from shardengine.data.proportions import check_proportions


def parse_proportions(text: str) -> list[float] | str:
    """``"auto"`` or comma-separated shares, ``"0.7,0.3"`` (checked against the world size later)."""
    if text == "auto":
        return text
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"proportions must be 'auto' or comma-separated numbers such as 0.7,0.3, "
                         f"got {text!r}") from None


class Windows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: (input, next-token target) pairs."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def rank_batch_sizes(global_batch: int, proportions: Sequence[float]) -> list[int]:
    """Every rank's micro-batch; an error if a rank would get no sequence at all."""
    sizes = se.data.proportional_counts(global_batch, proportions)
    empty = [r for r, size in enumerate(sizes) if size == 0]
    if empty:
        raise se.ConfigError(f"rank {empty[0]}'s share {proportions[empty[0]]:g} of the global micro-batch "
                             f"{global_batch} is 0 sequences: raise --micro-batch or that rank's share")
    return sizes


class ProportionalBatches:
    """This rank's micro-batches, ``proportional_counts(global_batch, shares)[rank]`` sequences each.

    Every rank makes the same number of micro-steps per epoch (the fewest any rank's
    share allows), so no rank runs out before the others; the few sequences left
    over are skipped that epoch. New shares start a new epoch.
    """

    def __init__(self, dataset: Dataset, global_batch: int, proportions: Sequence[float], seed: int = 0,
                 rank: Optional[int] = None, num_replicas: Optional[int] = None) -> None:
        self.dataset, self.global_batch = dataset, global_batch
        self.sampler = se.data.ProportionalSampler(dataset, proportions, seed=seed, rank=rank,
                                                   num_replicas=num_replicas)
        self.sizes = rank_batch_sizes(global_batch, self.sampler.proportions)
        self.epoch, self.position = 0, 0
        self._batches = self._epoch_batches()

    @property
    def proportions(self) -> tuple[float, ...]:
        return self.sampler.proportions

    @property
    def batch_size(self) -> int:
        return self.sizes[self.sampler.rank]

    def steps_per_epoch(self) -> int:
        steps = min(count // size for count, size in zip(self.sampler.counts(), self.sizes))
        if steps == 0:
            raise se.ConfigError(f"the dataset's {len(self.dataset)} windows cannot fill one global micro-batch "
                                 f"of {self.global_batch} with shares {list(self.proportions)}")
        return steps

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) micro-batch of this rank."""
        if self.position == len(self._batches):
            self.epoch, self.position = self.epoch + 1, 0
            self._batches = self._epoch_batches()
        self.position += 1
        return self._batches[self.position - 1]

    def set_proportions(self, proportions: Sequence[float]) -> None:
        """Every rank the same shares, from a fresh epoch on."""
        sizes = rank_batch_sizes(self.global_batch, check_proportions(proportions, len(self.sizes)))
        self.sampler.set_proportions(proportions)
        self.sizes = sizes
        self.epoch, self.position = self.epoch + 1, 0
        self._batches = self._epoch_batches()

    def _epoch_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_epoch(self.epoch)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler, drop_last=True)
        steps = self.steps_per_epoch()
        return [(inputs, targets) for _, (inputs, targets) in zip(range(steps), loader)]

    def state_dict(self) -> dict:
        return {"proportions": list(self.proportions), "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.set_proportions(state["proportions"])
        self.epoch = state["epoch"]
        self._batches, self.position = self._epoch_batches(), state["position"]


@dataclasses.dataclass
class ShareTuner:
    """``proportions="auto"``: ``rounds`` times, time each rank's work over ``window`` steps
    (after one untimed step: new batch sizes warm up), then re-balance the shares.

    ``floor_samples``: no rank's share falls below this many sequences of the global batch.
    """

    global_batch: int
    window: int = 4
    rounds: int = 2
    floor_samples: int = 1
    rounds_done: int = 0
    _seconds: list = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.rounds_done >= self.rounds

    def record(self, work_seconds: float, proportions: Sequence[float]) -> Optional[tuple[list, list]]:
        """One step's work on this rank; at the end of a window (collective: every rank calls
        it every step) returns (new shares, every rank's mean work seconds per step)."""
        if self.done:
            return None
        self._seconds.append(work_seconds)
        if len(self._seconds) < self.window + 1:
            return None
        mine, self._seconds = sum(self._seconds[1:]) / self.window, []
        times = all_gather_object_default_group(mine)
        self.rounds_done += 1
        floor = min(1.0, 1.01 * self.floor_samples * len(times) / self.global_batch)
        shares = se.data.rebalance_proportions(proportions, step_times=times, smoothing=0.0, floor=floor)
        return shares, times


class UnevenData:
    """``--proportions``: this rank's batch stream and, for ``auto``, its tuner; checkpointable."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, proportions, seed: int,
                 auto_window: int = 4, auto_rounds: int = 2) -> None:
        auto = proportions == "auto"
        world = se.distributed.world_size()
        start = [1 / world] * world if auto else check_proportions(proportions, world)
        self.batches = ProportionalBatches(Windows(tokens, seq_len), global_batch, start, seed)
        self.tuner = ShareTuner(global_batch, auto_window, auto_rounds) if auto else None
        self.balanced_from = 1  # the first step run with the final shares

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.next()

    def after_step(self, step: int, work_seconds: float) -> Optional[str]:
        """Feed the tuner one step's work (collective under ``auto``); a log line when the shares changed."""
        if self.tuner is None:
            return None
        rebalanced = self.tuner.record(work_seconds, self.batches.proportions)
        if rebalanced is None:
            return None
        shares, times = rebalanced
        old = self.batches.proportions
        self.batches.set_proportions(shares)
        self.balanced_from = step + 1
        return (f"step {step}: re-balanced (round {self.tuner.rounds_done}/{self.tuner.rounds}): work ms/step "
                f"{slashed([t * 1e3 for t in times], '.1f')} at shares {slashed(old, '.3f')} -> shares "
                f"{slashed(shares, '.3f')}, micro-batches {slashed(self.batches.sizes, 'd')}")

    def state_dict(self) -> dict:
        return {**self.batches.state_dict(), "tuned_rounds": self.tuner.rounds_done if self.tuner else 0,
                "balanced_from": self.balanced_from}

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)
        self.balanced_from = state["balanced_from"]
        if self.tuner is not None:
            self.tuner.rounds_done = state["tuned_rounds"]


def slashed(values, spec: str) -> str:
    """One figure per rank: ``0.700/0.300``."""
    return "/".join(format(v, spec) for v in values)
