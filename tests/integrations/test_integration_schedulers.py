"""The trainers' shared pieces, in one process: schedulers follow the optimizer shard() returns,
and shard_trainer_class refuses what is not a Trainer."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardengine as se
from shardengine.integrations.schedulers import retarget_schedulers


def test_a_scheduler_built_before_shard_drives_the_returned_optimizer() -> None:
    net = torch.nn.Linear(4, 2)
    user = torch.optim.AdamW(net.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(user, step_size=1, gamma=0.5)
    model, optimizer = se.shard(net, user, stage=1)   # the user's own object, re-pointed at the slices
    assert optimizer is user
    assert retarget_schedulers([scheduler, None], user, optimizer) == 0  # nothing to move
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no "scheduler stepped before the optimizer"
        for expected in (0.5, 0.25):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            assert optimizer.param_groups[0]["lr"] == expected


def test_retarget_moves_a_scheduler_to_another_optimizer() -> None:
    first = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=1.0)
    second = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1, gamma=0.5)
    assert retarget_schedulers([scheduler], first, second) == 1
    second.step()
    scheduler.step()
    assert second.param_groups[0]["lr"] == 0.5
    assert retarget_schedulers([scheduler], first, second) == 0  # already moved: left alone


def test_shard_trainer_class_needs_a_trainer_subclass() -> None:
    transformers = pytest.importorskip("transformers")
    from shardengine.integrations.transformers import ShardTrainerMixin, shard_trainer_class

    cls = shard_trainer_class(transformers.Seq2SeqTrainer)
    assert cls.__name__ == "ShardSeq2SeqTrainer"
    assert issubclass(cls, ShardTrainerMixin) and issubclass(cls, transformers.Seq2SeqTrainer)
    with pytest.raises(TypeError, match="needs a transformers.Trainer subclass"):
        shard_trainer_class(torch.nn.Module)
