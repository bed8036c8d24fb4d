"""Rank workers of the Lightning Fabric tests (``test_integration_fabric.py``).

[Note: the reference]
The same litgpt-style loop (``fabric.setup``, ``fabric.no_backward_sync`` for all but the last
micro-batch of a window, ``fabric.backward`` of the loss divided by the accumulation count,
``fabric.clip_gradients(max_norm=)``, ``optimizer.step``) runs twice in one worker on the same
tiny language model, data order and optimizer: under Fabric's own ``DDPStrategy`` and under
``ShardFabricStrategy``. The final parameters and the clipped norms must agree.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import shardengine as se
from rank_pool import rank_world

import lightning_cases as cases  # noqa: E402  (filters Lightning's warnings)
import lightning as L  # noqa: E402
from shardengine.integrations.lightning import ShardFabricStrategy  # noqa: E402

STEPS, ACCUMULATE, CLIP = 3, 2, 0.05


def fabric_for(strategy: Any, precision: str = "32-true") -> L.Fabric:
    _, world = rank_world()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def train(fabric: L.Fabric, data: Any) -> tuple[Any, Any, list[float]]:
    torch.manual_seed(0)
    net = cases.TinyLM()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=cases.LR, weight_decay=0.1))
    batches = list(cases.loader(data))
    norms = []
    for step in range(STEPS):
        window = batches[step * ACCUMULATE:(step + 1) * ACCUMULATE]
        for index, (ids, targets) in enumerate(window):
            with fabric.no_backward_sync(model, enabled=index < len(window) - 1):
                fabric.backward(cases.lm_loss(model(ids), targets) / ACCUMULATE)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, norms


def fabric_equals_ddp(stage: int, root: str) -> dict:
    """Fabric's DDP, then the sharded run at ``stage``; the sharded run saves, and a fresh sharded model
    (stage 3 when ``stage`` < 3, else 1) loads it."""
    data = cases.dataset(STEPS * ACCUMULATE)
    ddp_model, _, ddp_norms = train(fabric_for("ddp"), data)
    want = {k: v.detach().clone() for k, v in ddp_model.state_dict().items()}
    fabric = fabric_for(ShardFabricStrategy(stage=stage))
    model, optimizer, norms = train(fabric, data)
    path = os.path.join(root, "ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "iter_num": STEPS})
    got = se.interop.consolidated_state_dict(path) if rank_world()[0] == 0 else {}
    other = fabric_for(ShardFabricStrategy(stage=3 if stage < 3 else 1))
    torch.manual_seed(1)
    net = cases.TinyLM()
    fresh, fresh_optimizer = other.setup(net, torch.optim.AdamW(net.parameters(), lr=cases.LR, weight_decay=0.1))
    state = {"model": fresh, "optimizer": fresh_optimizer, "iter_num": 0}
    other.load(path, state)
    resumed = other.strategy.get_module_state_dict(fresh)   # full on rank 0; collective
    initial = cases.TinyLM().state_dict()
    result = {"ddp_norms": ddp_norms, "norms": norms, "iter_num": state["iter_num"]}
    if rank_world()[0] == 0:
        result["errors"] = cases.errors(got, want)
        result["resumed_equal"] = all(torch.equal(resumed[k], got[k]) for k in got)
        result["moved"] = max(cases.rel_err(want[k], initial[k]) for k in initial)
    return result


def precision_and_refusals() -> dict:
    """precision="bf16-mixed" is the engine's param_dtype; what the strategy refuses, by message."""
    found: dict[str, Any] = {}
    fabric = fabric_for(ShardFabricStrategy(stage=2), precision="bf16-mixed")
    torch.manual_seed(0)
    net = cases.TinyLM()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=cases.LR))
    ids, targets = next(iter(cases.loader(cases.dataset(1))))
    fabric.backward(cases.lm_loss(model(ids), targets))
    found["param_dtype"] = str(fabric.strategy.sharded_model.engine.config.param_dtype)
    found["compute_dtype"] = str(model(ids).dtype)

    def attempt(name, fn):
        try:
            fn()
            found[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the message is the test's subject
            found[name] = f"{type(error).__name__}: {error}"

    attempt("clip_value", lambda: fabric.clip_gradients(model, optimizer, clip_val=0.1))
    attempt("norm_type", lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=1))
    attempt("bf16_true", lambda: fabric_for(ShardFabricStrategy(stage=1), precision="bf16-true"))
    attempt("dtype_conflict", lambda: fabric_for(ShardFabricStrategy(stage=1, param_dtype="fp16"),
                                                 precision="bf16-mixed"))
    attempt("option", lambda: ShardFabricStrategy(stage=2, bucket_size=3))
    separate = fabric_for(ShardFabricStrategy(stage=1))
    plain = separate.setup_module(cases.TinyLM())
    attempt("setup_optimizers", lambda: separate.setup_optimizers(torch.optim.SGD(plain.parameters(), lr=0.1)))
    two = cases.TinyLM()
    attempt("two_optimizers", lambda: fabric_for(ShardFabricStrategy(stage=1)).setup(
        two, torch.optim.SGD(two.head.parameters(), lr=0.1), torch.optim.SGD(two.embed.parameters(), lr=0.1)))
    return found
