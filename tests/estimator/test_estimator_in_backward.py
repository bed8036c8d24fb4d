"""The estimator's shardengine model with ``step_in_backward=True`` equals the engine's bytes.

With the step inside backward (shardengine/stages/in_backward.py) the gradients held at the
step, which now happens inside backward, are the slice of the bucket that just landed at
stages 2-3 (stage 1: its full gradient buckets, as without the option); the estimator's
``grads`` for ``optimizer_in_backward=True`` is the largest of those. Here it is compared
with the most ``memory_report().grads`` reads at any landing, on random small models, world
sizes 1-3, stages 1-3; params and optimizer states as in test_estimator_engine_agreement.py.
Stage 0 and optimizer offload, which the engine refuses with it, are not planned.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from memory_estimator import EngineOptions, estimate
from memory_estimator.engines.shardengine_exact import exact_engine_model
from memory_estimator.terms.model_states import plan_spec
from rank_pool import RankPoolRegistry, run_local
from test_estimator_engine_agreement import random_net, specs as agreement_specs
from toy_models import make_optimizer

pytestmark = pytest.mark.prestart(2, 3)


def engine_report_in_backward(spec: dict) -> dict:
    """Rank worker: two steps with step_in_backward; memory_report() with the gradients at
    their most (sampled as each bucket lands) and after backward."""
    import torch.distributed as dist

    import shardengine as se

    if dist.is_initialized():
        torch.set_num_threads(1)
    torch.manual_seed(0)
    net = random_net(spec)
    options = {"param_dtype": spec["precision"]} if spec["precision"] != "fp32" else {}
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                bucket_mb=spec["bucket_mb"], step_in_backward=True, **options)
    landed, most = model.engine.in_backward.landed, [0]

    def sampling(bucket):
        most[0] = max(most[0], model.memory_report().grads)
        landed(bucket)
    model.engine.in_backward.landed = sampling
    for _ in range(2):  # the second with the optimizer state in place
        ids = torch.randint(spec["vocab"], (2, 3))
        F.cross_entropy(model(ids).float().reshape(-1, spec["vocab"]), ids.reshape(-1)).backward()
        after_backward = model.memory_report().grads
        optimizer.step()
        optimizer.zero_grad()
    report = model.memory_report().as_dict()
    return {**report, "grads": most[0], "after_backward": after_backward}


def predicted(spec: dict, world_size: int) -> dict:
    """The exact model's terms with the step in backward (the bytes at the step, which the
    plan's peak may not be: a model whose activations dominate peaks in forward)."""
    net = random_net(spec)
    options = EngineOptions(bucket_mb=spec["bucket_mb"])
    result = estimate(module=net, world_size=world_size, precision=spec["precision"], optimizer=spec["optimizer"],
                      engine_options=options, device_memory_bytes=10**15, optimizer_in_backward=True)
    assert [p.name for p in result.plans] == ["zero1", "zero2", "zero3"]  # what shard() accepts with it
    terms = exact_engine_model(net, world_size, options).terms(plan_spec(["zero1", "zero2", "zero3"][spec["stage"] - 1]),
                                                        spec["precision"], spec["optimizer"], "plain", 1,
                                                        in_backward=True)
    return {"params": terms.params, "grads": terms.grads, "optimizer_states": terms.optimizer_states}


# The agreement test's random models, at the stages and precisions shard() accepts with it.
specs = agreement_specs.filter(lambda spec: spec["stage"] >= 1 and spec["precision"] != "pure-bf16")


@settings(max_examples=12)
@given(spec=specs, world_size=st.sampled_from((1, 2, 3)))
def test_estimator_in_backward_equals_engine_memory_report(rank_pools: RankPoolRegistry, spec: dict,
                                                           world_size: int) -> None:
    if world_size == 1:
        reports = run_local(engine_report_in_backward, spec)
    else:
        reports = rank_pools.get(world_size).run(engine_report_in_backward, spec)
    expected = predicted(spec, world_size)
    largest = {key: max(report[key] for report in reports) for key in expected}
    assert largest == expected, f"engine's largest rank {largest} != estimator {expected}"
    assert all(report["after_backward"] == 0 for report in reports)
