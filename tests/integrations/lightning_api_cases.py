"""Rank workers of the ShardStrategy API audit (``test_integration_lightning_api.py``): what each
``Strategy`` method answers after ``trainer.fit``, against Lightning's contract.

[Note: the reference]
``lightning_module_state_dict`` and ``optimizer_state`` follow
``FSDPStrategy(state_dict_type="full")``: full values on rank 0, ``{}`` elsewhere, in the
LightningModule's own keys and torch's optimizer format. Their values are checked against what
the run's last checkpoint directory holds, read back with no process group
(``se.interop.consolidated_state_dict`` / ``se.interop.consolidated_optimizer_state_dict``), which the checkpoint
tests check against the engine; shapes and keys against a fresh LightningModule.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import shardengine as se
from rank_pool import rank_world
from shardengine.integrations.lightning.step_module import strip_prefix

import lightning_cases as cases  # noqa: E402  (filters Lightning's warnings, imports lightning)
import lightning.pytorch as pl  # noqa: E402


class LitWithTest(cases.LitLM):
    def test_step(self, batch, batch_idx):
        ids, targets = batch
        self.log("test_loss", cases.lm_loss(self(ids), targets), sync_dist=True)


class SeenAtSave(pl.Callback):
    """What a callback's ``on_save_checkpoint`` finds in Lightning's checkpoint dict."""

    def __init__(self) -> None:
        self.weights: dict[str, tuple] = {}
        self.optimizer_keys: list = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.weights = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
        self.optimizer_keys = [sorted(state) for state in checkpoint.get("optimizer_states", [])]


def strategy_answers(stage: int, root: str) -> dict[str, Any]:
    """Fit 2 steps with a ModelCheckpoint keeping the best 1 of a checkpoint per step, then ask."""
    rank, world = rank_world()
    data = cases.dataset(2)
    seen = SeenAtSave()
    saver = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), save_top_k=1, monitor="train_loss",
                                         every_n_train_steps=1, filename="{step}")
    trainer = cases.trainer(stage, root, callbacks=[saver, seen], max_steps=2)
    lit = LitWithTest()
    trainer.fit(lit, cases.loader(data))
    strategy = trainer.strategy
    weights = strategy.lightning_module_state_dict()
    optimizer_state = strategy.optimizer_state(trainer.optimizers[0])
    last = os.path.join(root, "final.ckpt")
    trainer.save_checkpoint(last)  # the strategy's save: a sharded directory of the final weights
    answers: dict[str, Any] = {
        "rank": rank,
        "weights_keys": sorted(weights),
        "optimizer_state_keys": sorted(optimizer_state),
        "seen_weights": seen.weights,
        "seen_optimizer_keys": seen.optimizer_keys,
        "checkpoint_files": sorted(os.listdir(os.path.join(root, "ckpts"))),
        "final_is_directory": os.path.isdir(last),
        "reduce_sum": float(strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum")),
        "broadcast": strategy.broadcast(f"from rank {rank}"),
        "all_gather": strategy.all_gather(torch.tensor([rank])).flatten().tolist(),
        "test_loss": trainer.test(lit, cases.loader(data), verbose=False)[0]["test_loss"],
        "world": world,
    }
    strategy.barrier()
    if rank == 0:
        # the engine names the parameters under its one-forward root ("lightning_module.<name>")
        answers["weights_equal_checkpoint"] = _equal(weights, strip_prefix(se.interop.consolidated_state_dict(last)))
        answers["weights_shapes_equal_module"] = {k: tuple(v.shape) for k, v in weights.items()} == \
            {k: tuple(v.shape) for k, v in cases.LitLM().state_dict().items()}
        answers["optimizer_equal_checkpoint"] = _equal_optimizer(optimizer_state,
                                                                 se.interop.consolidated_optimizer_state_dict(last))
        fresh = cases.LitLM()
        plain = torch.optim.AdamW(fresh.parameters(), lr=cases.LR, weight_decay=0.1)
        plain.load_state_dict(optimizer_state)  # torch's own format: a plain optimizer takes it
        answers["plain_optimizer_steps"] = [int(s["step"]) for s in plain.state_dict()["state"].values()]
        answers["moved"] = max(cases.rel_err(weights[k], fresh.state_dict()[k]) for k in weights)
    return answers


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def _equal_optimizer(got: dict, want: dict) -> bool:
    if sorted(got["state"]) != sorted(want["state"]) or len(got["param_groups"]) != len(want["param_groups"]):
        return False
    for position, state in want["state"].items():
        for name, value in state.items():
            if not torch.equal(torch.as_tensor(got["state"][position][name]), torch.as_tensor(value)):
                return False
    return all(g["params"] == w["params"] and g["lr"] == w["lr"]
               for g, w in zip(got["param_groups"], want["param_groups"]))
