"""Rank workers of the Lightning integration tests (``test_integration_lightning.py``).

[Note: the reference]
Lightning's run and the reference run happen in the same worker, on the same
tiny language model built from the same seed: the reference is the
hand-written ``se.shard`` loop of the README (same AdamW, the same per-step
LambdaLR built over the optimizer ``shard()`` returned, micro-batches of the
same ``DistributedSampler`` order, all but the last under ``no_sync``, each
loss divided by the accumulation count, ``model.clip_grad_norm_`` before the
step). Lightning must end with the same parameters.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardengine as se
from rank_pool import rank_world

warnings.filterwarnings("ignore", message=".*(does not have many workers|GPU available|TPU available|"
                                          "LOCAL_RANK|num_workers|ModelCheckpoint|sync_dist|"
                                          "precision is not supported).*")
import lightning.pytorch as pl  # noqa: E402

from engine_cases import rel_err  # noqa: E402
from shardengine.integrations.lightning import ShardStrategy, consolidate_checkpoint  # noqa: E402

VOCAB, SEQ, WIDTH, LAYERS = 32, 8, 16, 2
BATCH, LR = 2, 0.02


# --------------------------------------------------------------------------- model and data


class TinyLM(nn.Module):
    """Embedding -> ModuleList of residual MLP blocks (the stage-3 units) -> norm -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                                  nn.Linear(2 * WIDTH, WIDTH)) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


class LitLM(pl.LightningModule):
    def __init__(self, lr: float = LR):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = TinyLM()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        loss = lm_loss(self(ids), targets)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, targets = batch
        self.log("val_loss", lm_loss(self(ids), targets), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset(batches_per_rank: int, world: int = 2, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batches_per_rank * BATCH * world, SEQ + 1), generator=generator)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def loader(data: TensorDataset, batch: int = BATCH) -> DataLoader:
    """This rank's batches in a fixed order (the reference loop iterates the same ones)."""
    rank, world = rank_world()
    return DataLoader(data, batch_size=batch,
                      sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False))


def trainer(stage: int, root: Optional[str] = None, callbacks: Optional[list] = None, **kwargs: Any) -> pl.Trainer:
    strategy_options = kwargs.pop("strategy_options", {})
    _, world = rank_world()
    return pl.Trainer(accelerator="cpu", devices=world, strategy=ShardStrategy(stage=stage, **strategy_options),
                      logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks or [],
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      use_distributed_sampler=False, default_root_dir=root, **kwargs)


# --------------------------------------------------------------------------- the reference loop


def reference_loop(data: TensorDataset, steps: int, accumulate: int, clip: Optional[float], stage: int,
                   options: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """The README's hand-written loop on the same model, data order, optimizer and schedule."""
    rank, world = rank_world()
    torch.manual_seed(0)
    net = TinyLM()
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1),
                                stage=stage, **(options or {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    batches = list(loader(data))
    for step in range(steps):
        window = batches[step * accumulate:(step + 1) * accumulate]
        for index, (ids, targets) in enumerate(window):
            sync = index == len(window) - 1
            with (model.no_sync() if not sync else _nothing()):
                (lm_loss(model(ids), targets) / accumulate).backward()
        if clip is not None:
            model.clip_grad_norm_(clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {"net." + key: value for key, value in model.full_state_dict().items()}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return {key: rel_err(got[key], want[key]) for key in want}


# --------------------------------------------------------------------------- workers


def fit_equals_loop(stage: int, steps: int = 3, accumulate: int = 2, clip: Optional[float] = 0.05,
                    precision: str = "32-true") -> dict:
    """fit() with accumulate_grad_batches and gradient_clip_val, then validate() and predict() on the
    same trainer; the final parameters against the reference loop's."""
    data = dataset(steps * accumulate)
    lit = LitLM()
    initial = {key: value.clone() for key, value in lit.state_dict().items()}
    run = trainer(stage, max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                  precision=precision, limit_val_batches=2)
    run.fit(lit, loader(data))
    state = run.strategy.consolidated_state_dict()
    lr_now = run.strategy.sharded_optimizer.param_groups[0]["lr"]
    metrics = run.validate(lit, loader(data), verbose=False)
    predictions = run.predict(lit, loader(dataset(1, seed=5)))
    options = {"param_dtype": "bf16"} if precision == "bf16-mixed" else {}
    want = reference_loop(data, steps, accumulate, clip, stage, options)
    rank, _ = rank_world()
    return {"errors": errors(state, want) if rank == 0 else {}, "lr": lr_now,
            "moved": max(rel_err(state[k], initial[k]) for k in initial) if rank == 0 else 0.0, "val_loss": metrics[0]["val_loss"],
            "predictions": [p.tolist() for p in predictions], "global_step": run.global_step}


def save_resume(stage: int, resume_stage: int, root: str) -> dict:
    """Two epochs with a ModelCheckpoint after each; then a fresh module and trainer resume from the
    first epoch's checkpoint (ckpt_path=) at ``resume_stage`` and finish the second."""
    data = dataset(2)
    saver = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), save_top_k=-1,
                                         every_n_epochs=1, filename="{epoch}")
    first = trainer(stage, root, callbacks=[saver], max_epochs=2)
    first.fit(LitLM(), loader(data))
    uninterrupted = first.strategy.consolidated_state_dict()
    resumed_run = trainer(resume_stage, root, max_epochs=2)
    resumed_run.fit(LitLM(), loader(data), ckpt_path=os.path.join(root, "ckpts", "epoch=0.ckpt"))
    resumed = resumed_run.strategy.consolidated_state_dict()
    rank, _ = rank_world()
    return {"errors": errors(resumed, uninterrupted) if rank == 0 else {}, "final": uninterrupted,
            "identical": rank != 0 or all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted),
            "global_step": resumed_run.global_step, "epoch": resumed_run.current_epoch,
            "lr": resumed_run.strategy.sharded_optimizer.param_groups[0]["lr"],
            "files": sorted(os.listdir(os.path.join(root, "ckpts")))}


def resume_at_other_world(root: str, ckpt: str, saved_world: int = 2) -> dict:
    """Resume a checkpoint saved at ``saved_world`` ranks (by save_resume) on this world size, with the
    per-rank batch scaled so that every step sees the same global batch, and finish the run."""
    _, world = rank_world()
    data = dataset(2, world=saved_world)
    run = trainer(2, root, max_epochs=2)
    run.fit(LitLM(), loader(data, batch=BATCH * saved_world // world), ckpt_path=ckpt)
    return {"global_step": run.global_step, "state": run.strategy.consolidated_state_dict(),
            "lr": run.strategy.sharded_optimizer.param_groups[0]["lr"]}


def load_one_file(root: str, path: str, sharded: str) -> dict:
    """fit(ckpt_path=<a one-file .ckpt>) loads its weights into the sharded model (its run was over,
    so nothing trains); validate(ckpt_path=<a sharded directory>) on a trainer that never fitted
    loads the full weights into every rank's plain module. Both against the exported weights."""
    run = trainer(2, root, max_epochs=2)
    run.fit(LitLM(), loader(dataset(2)), ckpt_path=path)
    from_file = run.strategy.consolidated_state_dict()
    fresh, lit = trainer(3, root), LitLM()
    fresh.validate(lit, loader(dataset(2)), ckpt_path=sharded, verbose=False)
    return {"state": from_file, "global_step": run.global_step,
            "validated": {key: value.clone() for key, value in lit.state_dict().items()}}


def export_and_reload(ckpt: str, out: str) -> dict:
    """Consolidate a ShardStrategy checkpoint (no process group) and load it as Lightning does."""
    consolidate_checkpoint(ckpt, out)
    lit = LitLM.load_from_checkpoint(out)
    return {key: value.clone() for key, value in lit.state_dict().items()}


def bad_combinations(root: str) -> dict[str, str]:
    """Each unsupported combination's error message (raised on every rank alike)."""
    found = {}

    def attempt(name, fn):
        try:
            fn()
            found[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the message is the test's subject
            found[name] = f"{type(error).__name__}: {error}"

    attempt("option", lambda: ShardStrategy(stage=2, bucket_size=3))
    attempt("stage", lambda: ShardStrategy(stage=5))
    attempt("precision", lambda: trainer(1, precision="bf16-true"))
    attempt("dtype_conflict", lambda: trainer(1, precision="bf16-mixed",
                                              strategy_options={"param_dtype": "fp16"}))
    attempt("clip_value", lambda: trainer(2, max_steps=1, gradient_clip_val=0.1,
                                          gradient_clip_algorithm="value").fit(LitLM(), loader(dataset(1))))
    attempt("two_optimizers", lambda: trainer(1, max_steps=1).fit(TwoOptimizers(), loader(dataset(1))))
    return found


class TwoOptimizers(LitLM):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.head.parameters(), lr=0.1),
                torch.optim.SGD(self.net.embed.parameters(), lr=0.1)]
