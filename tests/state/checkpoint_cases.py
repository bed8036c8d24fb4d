"""Model, data and rank workers for the checkpoint tests; also a torchrun training script.

Every function here runs on a pool rank (``rank_pools.get(n).run(fn, ...)``);
rank and world size come from the process group. Run as a script under
torchrun, this module trains with ``--checkpoint-every`` / resume-from-latest
and may SIGKILL one of its ranks once (the kill-a-rank test).

[Note: data]
``train`` draws each step's batch from the *global* torch RNG (seeded per rank
at the start), so an exact resume is only bit-identical if the checkpoint
restores the RNG too. ``step_batches`` instead derives batches from (seed,
rank), so a reference can rebuild every rank's batch in one process.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardengine as se
from rank_pool import rank_world
from shardengine.errors import CheckpointError
from shardengine.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from toy_models import make_optimizer

VOCAB, DIM, BATCH, SEQ = 11, 6, 4, 3


# --------------------------------------------------------------------------- model and data


class TinyNet(nn.Module):
    """Embedding -> blocks -> head tied to the embedding; a frozen bias; a buffer forward updates.

    Odd widths so flat buffers need padding and parameters straddle shard edges.
    """

    def __init__(self, dim: int = DIM, hidden: int = 7):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, dim)])
        self.head = nn.Linear(dim, VOCAB)
        self.head.weight = self.embed.weight
        self.blocks[0].bias.requires_grad_(False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.embed(idx).mean(1)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def make_net(dim: int = DIM) -> TinyNet:
    torch.manual_seed(0)
    return TinyNet(dim)


# AdamW with two param groups (the head's bias has its own lr and no weight decay)
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "groups": "head_bias"}


def build(stage: int, dim: int = DIM, **options: Any):
    net = make_net(dim)
    return se.shard(net, make_optimizer(net, **OPTIMIZER), stage=stage, **options)


def loss_of(model, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx), targets)


def train(model, optimizer, steps: int) -> None:
    """``steps`` optimizer steps on batches from the global RNG (see the Note)."""
    for _ in range(steps):
        idx, targets = torch.randint(VOCAB, (BATCH, SEQ)), torch.randint(VOCAB, (BATCH,))
        loss_of(model, idx, targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def step_batches(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(VOCAB, (BATCH, SEQ), generator=gen), torch.randint(VOCAB, (BATCH,), generator=gen)


def snapshot(model, optimizer) -> dict:
    """Everything a failed load must leave untouched: parameters, buffers, optimizer state."""
    opt = optimizer.state_dict()
    state = {index: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for index, s in opt["state"].items()}
    return {"model": model.full_state_dict(), "state": state,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]}


def same(a: Any, b: Any) -> bool:
    """Bit-identical nested structures of tensors."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- rank workers


def exact_resume(stage: int, ckpt_dir: str, **options: Any) -> dict:
    """4 steps straight vs 2 steps, save, fresh model + optimizer, load, 2 steps.

    ``options`` go to ``shard()`` (mixed precision, offload). With a loss
    scaler, its scale is set to an unusual value before saving, and the
    resumed run must come back with it.
    """
    rank, _ = rank_world()
    torch.manual_seed(100 + rank)
    model, optimizer = build(stage, **options)
    train(model, optimizer, 4)
    straight = model.full_state_dict()
    torch.manual_seed(100 + rank)
    model, optimizer = build(stage, **options)
    train(model, optimizer, 2)
    scaler = model.engine.scaler
    if scaler is not None:  # an unusual scale that the load must bring back
        scale_in_use, scaler.scale = scaler.scale, 1024.0
    save_checkpoint(ckpt_dir, model, optimizer, extra={"step": 2, "note": "half way"})
    torch.rand(7)  # move the RNG on: the load must bring it back
    model, optimizer = build(stage, **options)
    extra = load_checkpoint(ckpt_dir, model, optimizer)
    restored_scale = model.engine.scaler.scale if scaler is not None else None
    if scaler is not None:
        model.engine.scaler.scale = scale_in_use  # continue like the straight run
    train(model, optimizer, 2)
    resumed = model.full_state_dict()
    return {"extra": extra, "identical": same(straight, resumed), "restored_scale": restored_scale,
            "differs": [k for k in straight if not torch.equal(straight[k], resumed[k])]}


def train_and_save(stage: int, ckpt_dir: str, steps: int, keep: Optional[int] = 3, **options: Any) -> dict:
    """Train ``steps`` steps (global-RNG data), save with ``extra={"step": steps}``; rank 0's full state."""
    rank, _ = rank_world()
    torch.manual_seed(200 + rank)
    model, optimizer = build(stage, **options)
    train(model, optimizer, steps)
    path = save_checkpoint(ckpt_dir, model, optimizer, extra={"step": steps}, keep=keep)
    return {"path": path, "full": model.full_state_dict(rank0_only=True),
            "full_optimizer": model.full_optimizer_state_dict(optimizer, rank0_only=True)}


def load_resave_and_step(stage: int, ckpt_dir: str, resave_dir: str, seed: int, **options: Any) -> dict:
    """Load (any saved world/stage), save again at this world/stage, then one step on known batches."""
    rank, _ = rank_world()
    model, optimizer = build(stage, **options)
    extra = load_checkpoint(ckpt_dir, model, optimizer)
    save_checkpoint(resave_dir, model, optimizer, extra=extra)
    idx, targets = step_batches(seed, rank)
    loss_of(model, idx, targets).backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"extra": extra, "after_step": model.full_state_dict(rank0_only=True)}


def failed_load(stage: int, ckpt_dir: str, dim: int = DIM) -> dict:
    """Try to load a damaged (or foreign) checkpoint: the error text, and whether anything changed."""
    rank, _ = rank_world()
    torch.manual_seed(300 + rank)
    model, optimizer = build(stage, dim=dim)
    train(model, optimizer, 1)
    before = snapshot(model, optimizer)
    try:
        load_checkpoint(ckpt_dir, model, optimizer)
        error = None
    except CheckpointError as caught:
        error = str(caught)
    return {"error": error, "unchanged": same(before, snapshot(model, optimizer))}


def save_with_fault(stage: int, ckpt_dir: str, failing_rank: int) -> dict:
    """A save whose rank file write fails on one rank: everyone raises, ``latest`` stays put."""
    import shardengine.state.checkpoint.writing as ck

    rank, _ = rank_world()
    model, optimizer = build(stage)
    train(model, optimizer, 1)
    original = ck._write_file
    if rank == failing_rank:
        def broken(obj, path):
            with open(path, "wb") as f:
                f.write(b"half a file")
            raise OSError("disk full (injected)")
        ck._write_file = broken
    try:
        save_checkpoint(ckpt_dir, model, optimizer, extra={"step": 99})
        error = None
    except CheckpointError as caught:
        error = str(caught)
    finally:
        ck._write_file = original
    return {"error": error}


def full_state_rank0_only(stage: int) -> dict:
    rank, _ = rank_world()
    torch.manual_seed(400 + rank)
    model, optimizer = build(stage)
    train(model, optimizer, 2)
    return {"rank0": model.full_state_dict(rank0_only=True), "all": model.full_state_dict()}


def hang_mid_step(timeout_s: float, hanging_rank: int, hang_s: float) -> dict:
    """One rank stalls before backward; the other must stop with an error naming the collective."""
    rank, _ = rank_world()
    model, optimizer = build(2, timeout_s=timeout_s)
    train(model, optimizer, 1)
    idx, targets = step_batches(0, rank)
    loss = loss_of(model, idx, targets)
    if rank == hanging_rank:
        time.sleep(hang_s)
        return {"hung": True}
    started = time.perf_counter()
    try:
        loss.backward()
        optimizer.step()
        outcome = {"error_type": None, "message": None}
    except RuntimeError as error:
        outcome = {"error_type": type(error).__name__, "message": str(error),
                   "is_collective_error": isinstance(error, se.CollectiveError)}
    outcome["seconds"] = time.perf_counter() - started
    return outcome


# --------------------------------------------------------------------------- torchrun script


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="train TinyNet with checkpoints; optionally kill a rank once")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--out", default=None, help="rank 0 writes the final full state dict here")
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--marker", default=None, help="file created when the kill happens (kill once)")
    p.add_argument("--timeout-s", type=float, default=10.0)
    return p.parse_args(argv)


def maybe_kill(args: argparse.Namespace, step: int, rank: int) -> None:
    """SIGKILL this rank at the chosen step, on the first attempt only (the marker remembers)."""
    if rank != args.kill_rank or step != args.kill_at_step or os.path.exists(args.marker):
        return
    with open(args.marker, "w") as f:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        f.write(f"killed rank {rank} at step {step}, attempt {attempt}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def train_with_checkpoints(args: argparse.Namespace) -> dict:
    """The script's training loop (also run in-pool, uninterrupted, as the reference)."""
    rank, _ = rank_world()
    torch.manual_seed(500 + rank)
    model, optimizer = build(args.stage, timeout_s=args.timeout_s)
    start = 0
    if latest_checkpoint(args.checkpoint_dir) is not None:
        start = load_checkpoint(args.checkpoint_dir, model, optimizer)["step"]
        if rank == 0:
            print(f"resumed from step {start} (attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')})",
                  flush=True)
    for step in range(start + 1, args.steps + 1):
        if args.kill_rank is not None:
            maybe_kill(args, step, rank)
        train(model, optimizer, 1)
        if step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, model, optimizer, extra={"step": step})
    return model.full_state_dict(rank0_only=True)


def reference_run(argv: list[str]) -> dict:
    """Pool worker: the same training, never interrupted."""
    return train_with_checkpoints(parse_args(argv))


def script_main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as in the pool: same kernels, bit-identical results
    info = se.init_distributed(timeout_s=args.timeout_s)  # per-attempt store prefix: see distributed/launch.py
    final = train_with_checkpoints(args)
    if info.rank == 0:
        torch.save(final, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    script_main()
