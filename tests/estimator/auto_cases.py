"""The long-context cases of stage="auto"'s activation levers, shared by the estimator's tests of
its choice (test_estimator_auto_plan.py) and the engine's run of it (test_auto_activation_levers.py).

An 8-layer GPT (width 64) at sequence 2048 on 2 CPU ranks, fp32 AdamW: activations dominate.
The budgets come from the planner's own candidates (one search at a large budget: a
candidate's device bytes per rank do not depend on the budget), so each case is the budget
where nothing with fewer levers fits.
"""
from __future__ import annotations

import torch
from torch import nn

from memory_estimator import (EngineOptions, EngineRequest, EstimateRequest, ModelRequest, TargetRequest,
                              TrainingRequest, estimate)
from memory_estimator.plan.search import Levers, search
from memory_estimator.terms.model_states import plan_spec
from shardengine.testing.models import build_gpt, example_inputs

MARGIN = 0.9   # the estimator's default safety margin keeps 10% of the device free
LONG = dict(n_layer=8, n_embd=64, n_head=2, seq_len=2048, vocab_size=256)
SEQ_LEN, WORLD = 2048, 2


def gpt(**shape) -> nn.Module:
    torch.manual_seed(0)
    return build_gpt("tiny", **shape)


def batch(micro_batch: int, seq_len: int):
    """(token ids, targets): the model returns its loss, as it trains."""
    return example_inputs(micro_batch, seq_len, vocab_size=LONG["vocab_size"])


def request(module: nn.Module, budget: int, micro_batch: int = 1, seq_len: int = SEQ_LEN, world_size: int = WORLD,
            implied: bool = False, **training) -> EstimateRequest:
    """What shard(stage="auto") asks on a CPU rank (shardengine/auto.py's _request); ``implied``:
    without example inputs (auto builds those the model implies)."""
    return EstimateRequest(
        ModelRequest(module=module, example_inputs=None if implied else batch),
        TrainingRequest(world_size=world_size, precision="fp32", optimizer=torch.optim.AdamW(module.parameters()),
                        micro_batch=micro_batch, seq_len=seq_len, **training),
        engine=EngineRequest(options=EngineOptions(reduces_in_place=True)),
        target=TargetRequest(device="cpu", device_memory_bytes=budget, host_memory_bytes=2**40,
                             ranks_per_node=world_size))


def on_host(plan: str) -> bool:
    spec = plan_spec(plan)
    return spec.offload_params or spec.partial_params


def long_context_candidates():
    """(the module, every candidate the planner tries for it at micro-batch 1)."""
    module = gpt(**LONG)
    return module, search(estimate(request(module, 2**40)), None, Levers()).candidates


def floor(candidates, keep) -> int:
    return min(run.memory_bytes for run in candidates if keep(run))


def budget_between(low: int, high: int) -> int:
    """A device budget whose usable part lies between ``low`` (fits) and ``high`` (does not)."""
    assert low < high, (low, high)
    return int((low + high) / 2 / MARGIN)


def lever_budgets(candidates) -> dict[str, int]:
    """Per case, the budget where nothing with fewer levers fits: checkpointing, activation
    offload, and all three together with the parameters on the host (the tightest)."""
    both = lambda run: run.activation_offload and on_host(run.plan) and run.checkpointing != "none"  # noqa: E731
    tightest = min(run.memory_bytes for run in candidates)
    return {
        "checkpointing": budget_between(floor(candidates, lambda run: run.checkpointing != "none"),
                                        floor(candidates, lambda run: run.checkpointing == "none")),
        "offload": budget_between(floor(candidates, lambda run: run.activation_offload and not on_host(run.plan)),
                                  floor(candidates, lambda run: not run.activation_offload)),
        "all": budget_between(tightest, floor(candidates, lambda run: not both(run))),
    }


def auto_step(budget: int) -> dict:
    """On a rank: shard(stage="auto") at ``budget``, one training step; what it chose and applied,
    what the run held (model states before the step, host tiers included, plus the most the step
    allocated: on CPU the device is host RAM) and what the plan promised (the device budget plus
    its host bytes per rank)."""
    import shardengine as se
    from shardengine.testing.allocator_tracker import AllocatorTracker

    module = gpt(**LONG)
    model, optimizer = se.shard(module, torch.optim.AdamW(module.parameters()), stage="auto", micro_batch=1,
                                seq_len=SEQ_LEN, example_inputs=batch, memory_budget_bytes=budget)
    choice, held = model.auto_plan, model.memory_report()
    idx, targets = batch(1, SEQ_LEN)
    with AllocatorTracker() as tracker:
        with tracker.phase("step"):
            model(idx, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    config = model.engine.config
    return {"checkpointing": choice.checkpointing, "activation_offload": choice.activation_offload,
            "plan": choice.plan, "applied": (getattr(config, "activation_checkpointing", "none"),
                                             getattr(config, "activation_offload", False)),
            "held": held.model_states + held.host_model_states + tracker.peak_in("step"),
            "promised": budget + choice.host_bytes}
