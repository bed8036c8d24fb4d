"""Worker functions for the DeepSpeed and DCP interop tests (tests/state/test_interop_*.py).

One model, one data stream and one optimizer for every framework: a tiny MLP with odd
sizes (so every flat layout pads), ``GLOBAL_BATCH`` rows per step split evenly over the
ranks (12 rows: 6 per rank at N = 2, 4 at N = 3), mean-squared error, torch's AdamW.
The mean of the ranks' means is the mean over the global batch at every world size,
so runs at N = 1, 2, 3 take the same steps.

DeepSpeed runs in its own processes (``deepspeed_references``: ``torch.multiprocessing``
spawn, Gloo), not in the rank pools: ``deepspeed.initialize`` changes process-wide state.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import shardengine as se

GLOBAL_BATCH = 12
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
GAMMA = 0.9  # StepLR(step_size=1): the learning rate changes every step, so a lost scheduler shows


def make_net(frozen: bool = False) -> nn.Module:
    """The MLP; ``frozen``: its first bias does not train (and has no optimizer state)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    net[0].bias.requires_grad_(not frozen)
    return net


def adamw(net: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], **ADAMW)


def make_optimizer(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = adamw(net)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch."""
    generator = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(GLOBAL_BATCH, 3, generator=generator)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def loss_of(model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = batch(step, rank, world)
    return (model(x) - y).pow(2).mean()


def train(model, optimizer, scheduler, steps: range) -> None:
    for step in steps:
        loss_of(model, step, dist.get_rank(), dist.get_world_size()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


# =========================================================================== shardengine


def shard_resume(stage: int, source: str, kind: str, first: int, total: int, frozen: bool = False) -> dict:
    """A sharded run resumed from ``source`` (``kind``: a converted ``.pt`` file or a DCP folder),
    trained on to step ``total``; its full weights and what the load returned besides."""
    net = make_net(frozen)
    model, optimizer = se.shard(net, adamw(net), stage=stage)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    if kind == "pt":
        rest = se.interop.load_training_state(model, optimizer, torch.load(source, weights_only=True))
    else:
        rest = se.interop.load_dcp_checkpoint(source, model, optimizer)
    if "lr_scheduler" in rest:
        scheduler.load_state_dict(rest["lr_scheduler"])
    else:
        scheduler = None
    train(model, optimizer, scheduler, range(first, total))
    return {"weights": model.state_dict(), "rest": sorted(rest), "lr": optimizer.param_groups[0]["lr"]}


def shard_save_dcp_and_continue(stage: int, path: str, first: int, total: int) -> dict:
    """A sharded run trained to step ``first``, exported as DCP, then trained on to ``total``."""
    net = make_net()
    model, optimizer = se.shard(net, adamw(net), stage=stage)
    train(model, optimizer, None, range(first))
    se.interop.save_dcp_checkpoint(path, model, optimizer, extra={"step": torch.tensor(first)})
    train(model, optimizer, None, range(first, total))
    return model.state_dict()


# =========================================================================== FSDP2


def _fsdp2_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    fully_shard(net[0])
    fully_shard(net)
    return net, adamw(net)


def _fsdp2_full_weights(net: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def fsdp2_save_dcp_and_continue(path: str, first: int, total: int, flatten: bool = False) -> dict:
    """FSDP2 trained to step ``first``, saved as torchtitan does (``flatten``: with
    ``flatten_optimizer_state_dict=True``, torchtitan's choice), then trained on to ``total``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    net, optimizer = _fsdp2_model()
    train(net, optimizer, None, range(first))
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    dcp.save({"model": get_model_state_dict(net), "optimizer": get_optimizer_state_dict(net, optimizer, options=options)},
             checkpoint_id=path)
    train(net, optimizer, None, range(first, total))
    return _fsdp2_full_weights(net)


def fsdp2_load_dcp_and_continue(path: str, first: int, total: int) -> dict:
    """FSDP2 restored with ``dcp.load`` from ``path`` (model and optimizer), trained on to ``total``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    net, optimizer = _fsdp2_model()
    state = {"model": get_model_state_dict(net), "optimizer": get_optimizer_state_dict(net, optimizer),
             "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, optimizer, state["optimizer"])
    steps = {float(s["step"]) for s in optimizer.state_dict()["state"].values()}
    train(net, optimizer, None, range(first, total))
    return {"weights": _fsdp2_full_weights(net), "optimizer_steps": sorted(steps), "step": int(state["step"])}


# =========================================================================== DeepSpeed


@dataclasses.dataclass(frozen=True)
class DeepSpeedRun:
    """One DeepSpeed training run: ZeRO ``stage``, a checkpoint in ``out/ds`` at step ``first``,
    and at ``total`` the final weights, as DeepSpeed's own zero_to_fp32 reads them, in
    ``out/final.pt``. With ``bf16`` DeepSpeed computes in bf16 and keeps fp32 masters in its
    optimizer files; ``frozen``: see :func:`make_net`."""

    stage: int
    out: str
    first: int
    total: int
    bf16: bool = False
    frozen: bool = False


def deepspeed_ranks(rank: int, world: int, port: int, runs: list[DeepSpeedRun]) -> None:
    """One DeepSpeed rank: each of ``runs`` in turn, in one process group.

    [Note: DeepSpeed runs share their processes]
    Starting two processes and importing DeepSpeed takes longer than a run of this model, so
    every reference a test module needs runs in one spawn. Each run builds its own model,
    optimizer and engine from the same seed, and DeepSpeed keeps no training state between
    engines, so a run's weights are the ones it gives in processes of its own.

    See [Note: DeepSpeed on CPU without its C++ extensions] in benchmarks/bench_memory_floor.py.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for run in runs:
        _deepspeed_train(rank, world, run)
    dist.destroy_process_group()


def _deepspeed_train(rank: int, world: int, run: DeepSpeedRun) -> None:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    bucket = 25 * 2**20 // 4  # 25 MiB of fp32 elements: DeepSpeed's default buckets are ~2 GB each
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": run.stage, "reduce_bucket_size": bucket,
                                    "allgather_bucket_size": bucket, "stage3_prefetch_bucket_size": bucket},
              "bf16": {"enabled": run.bf16}}
    net = make_net(run.frozen)
    optimizer, scheduler = make_optimizer(net)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    for step in range(run.total):
        if step == run.first:
            engine.save_checkpoint(os.path.join(run.out, "ds"))
        x, y = batch(step, rank, world)
        if run.bf16:
            x, y = x.bfloat16(), y.bfloat16()
        engine.backward((engine(x) - y).float().pow(2).mean())
        engine.step()
    engine.save_checkpoint(os.path.join(run.out, "ds_final"))
    dist.barrier()
    if rank == 0:
        torch.save(get_fp32_state_dict_from_zero_checkpoint(os.path.join(run.out, "ds_final")),
                   os.path.join(run.out, "final.pt"))
    engine.destroy()


def deepspeed_references(runs: list[DeepSpeedRun], world: int = 2) -> list[dict]:
    """Run DeepSpeed at ``world`` ranks, every one of ``runs`` in the same two processes (see
    :func:`deepspeed_ranks`); the final fp32 weights of each."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(deepspeed_ranks, args=(world, port, runs), nprocs=world, start_method="spawn")
    return [torch.load(os.path.join(run.out, "final.pt"), weights_only=True) for run in runs]


if __name__ == "__main__":  # python interop_cases.py STAGE OUT FIRST TOTAL: the DeepSpeed reference alone
    deepspeed_references([DeepSpeedRun(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))])
