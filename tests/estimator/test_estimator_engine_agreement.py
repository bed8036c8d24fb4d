"""The estimator's model-state bytes equal the engine's ``memory_report()`` exactly.

For random small models (tied weights, frozen blocks, odd sizes, an empty parameter,
a ModuleList so stage 3 has units, several buckets), world sizes 1-4, stages 0-3
(and stage 3 with optimizer offload, with the parameters on the host too, with a fraction
or device budget of them there, and both on the disk tier), Adam(W) / SGD / SGD-momentum and fp32 / bf16 /
pure-bf16: params, grads, optimizer states and host optimizer states per rank agree
to the byte after one optimizer step (Adam's state exists only after the first step).

pure-bf16 is a bf16 model sharded without ``param_dtype``: the engine's flat buffers
are then bf16 and the optimizer steps them directly, so its state is bf16 too (no
master) — except under offload, whose host master is a separate fp32 copy.

The estimator's per-rank figure is the largest rank's: the optimizer keeps state
per parameter fragment, so a rank whose slice ends in padding holds a little less.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from memory_estimator import EngineOptions, EstimatorInputError, estimate
from memory_estimator.terms.optimizers import optimizer_name
from rank_pool import RankPoolRegistry, run_local
from toy_models import Net, make_optimizer

WORLD_SIZES = (1, 2, 3, 4)


pytestmark = pytest.mark.prestart(*[n for n in WORLD_SIZES if n > 1])  # start-ups overlap (conftest.py)


def random_net(spec: dict) -> Net:
    """Embedding -> ModuleList of blocks -> head, shaped by a plain-data spec."""
    return Net(spec["vocab"], spec["dim"], spec["hidden"], tied=spec["tied"], frozen=spec["frozen"],
               buffer=False, bias=spec["bias"], empty=spec["empty"])


def engine_report_after_step(spec: dict) -> dict:
    """Rank worker: shard the spec's model, take one step, return memory_report() as a dict."""
    import torch.distributed as dist

    import shardengine as se

    if dist.is_initialized():
        torch.set_num_threads(1)
    torch.manual_seed(0)
    net = random_net(spec)
    options = dict(stage=spec["stage"], bucket_mb=spec["bucket_mb"], offload_optimizer=spec["offload"],
                   shard_group_size=spec.get("shard_group_size"))
    if spec.get("params_on_host"):  # stage 3's parameter and gradient shards on the host too
        options["offload_params"] = True
    if spec.get("partial"):  # a fraction or a device budget of the units on the host
        kind, value = spec["partial"]
        options["offload_params" if kind == "fraction" else "offload_device_budget"] = value
    if spec.get("disk"):  # the disk tier: the offloaded bytes in files under the temp directory
        options.update(offload_optimizer="disk", offload_path=tempfile.gettempdir())
        if spec.get("params_on_host"):  # ... the parameter shards too (the gradients stay on the host)
            options.update(offload_optimizer=False, offload_params="disk")
    if spec["precision"] == "pure-bf16":
        net = net.to(torch.bfloat16)  # the model itself in bf16, no param_dtype
    elif spec["precision"] != "fp32":
        options["param_dtype"] = spec["precision"]
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), **options)
    ids = torch.randint(spec["vocab"], (2, 3))
    F.cross_entropy(model(ids).float().reshape(-1, spec["vocab"]), ids.reshape(-1)).backward()
    optimizer.step()
    report = model.memory_report().as_dict()  # gradients held from backward to the step: the peak's
    optimizer.zero_grad()                      # frees them (set_to_none=True)
    return report


def predicted(spec: dict, world_size: int, live_optimizer: bool) -> dict:
    net = random_net(spec)  # a live module: the estimator must plan a meta copy of it
    optimizer = make_optimizer(net, spec["optimizer"]) if live_optimizer else spec["optimizer"]
    kind, value = spec.get("partial") or (None, None)
    partial = {"offload_params": value} if kind == "fraction" else {"offload_device_budget": value} if kind else {}
    result = estimate(module=net, world_size=world_size, precision=spec["precision"], optimizer=optimizer, **partial,
                      engine_options=EngineOptions(bucket_mb=spec["bucket_mb"],
                                                   shard_group_size=spec.get("shard_group_size")),
                      disk=spec.get("disk", False), device_memory_bytes=10**15)
    name = ["ddp", "zero1", "zero2", "zero3"][spec["stage"]] + ("-offload" if spec["offload"] else "")
    plan = result.plan(name + ("-params" if spec.get("params_on_host") else "") + ("-disk" if spec.get("disk") else "")) \
        if not kind else next(plan for plan in result.plans if plan.name.startswith("zero3-offload-params-"))
    assert not any(p.is_meta for p in net.parameters())  # the caller's module is untouched
    return {"params": plan.params, "grads": plan.grads, "optimizer_states": plan.optimizer_states,
            "host_optimizer_states": plan.host_optimizer_states,
            "disk_optimizer_states": plan.disk_bytes - plan.disk_params, "disk_params": plan.disk_params,
            "host_params": plan.host_params, "host_grads": plan.host_grads}


specs = st.fixed_dictionaries({
    "vocab": st.integers(3, 19),
    "dim": st.integers(1, 9),
    "hidden": st.lists(st.integers(1, 23), min_size=0, max_size=3),
    "bias": st.booleans(),
    "tied": st.booleans(),
    "frozen": st.one_of(st.none(), st.integers(0, 3)),
    "empty": st.booleans(),
    "stage": st.integers(0, 3),
    "offload": st.booleans(),
    "optimizer": st.sampled_from(["adamw", "sgd", "sgd-momentum"]),
    "precision": st.sampled_from(["fp32", "bf16", "pure-bf16"]),
    "bucket_mb": st.sampled_from([0.0002, 0.001, 25.0]),  # 0.0002 MiB = 52 floats: many buckets
})


@settings(max_examples=30)
@given(spec=specs, world_size=st.sampled_from(WORLD_SIZES), live_optimizer=st.booleans())
def test_estimator_model_states_equal_engine_memory_report(rank_pools: RankPoolRegistry, spec: dict,
                                                           world_size: int, live_optimizer: bool) -> None:
    spec = {**spec, "offload": spec["offload"] and spec["stage"] == 3}  # the estimator's offload plan
    check_agreement(rank_pools, spec, world_size, live_optimizer)


def check_agreement(rank_pools: RankPoolRegistry, spec: dict, world_size: int, live_optimizer: bool) -> None:
    if world_size == 1:
        reports = run_local(engine_report_after_step, spec)
    else:
        reports = rank_pools.get(world_size).run(engine_report_after_step, spec)
    expected = predicted(spec, world_size, live_optimizer)
    for rank, report in enumerate(reports):
        got = {key: report[key] for key in expected}
        same = {key: expected[key] for key in ("params", "grads", "host_params", "host_grads", "disk_params")}
        assert {key: got[key] for key in same} == same, f"rank {rank} of {world_size}: {got} != {expected}"
        assert all(got[key] <= expected[key]
                   for key in ("optimizer_states", "host_optimizer_states", "disk_optimizer_states"))
    largest = {key: max(report[key] for report in reports) for key in expected}
    assert largest == expected, f"engine's largest rank {largest} != estimator {expected}"


@settings(max_examples=8)
@given(spec=specs, world_size=st.sampled_from(WORLD_SIZES), live_optimizer=st.booleans())
def test_disk_tier_is_predicted_exactly(rank_pools: RankPoolRegistry, spec: dict, world_size: int,
                                       live_optimizer: bool) -> None:
    """``offload_optimizer="disk"``: the offload plan's bytes in files, none on the host."""
    spec = {**spec, "stage": 3, "offload": True, "disk": True}
    check_agreement(rank_pools, spec, world_size, live_optimizer)


@settings(max_examples=8)
@given(spec=specs, world_size=st.sampled_from(WORLD_SIZES), live_optimizer=st.booleans())
def test_parameters_on_the_host_are_predicted_exactly(rank_pools: RankPoolRegistry, spec: dict, world_size: int,
                                                      live_optimizer: bool) -> None:
    """``offload_params=True``: zero3-offload-params' bytes, each kind on the host, none on the device."""
    spec = {**spec, "stage": 3, "offload": True, "params_on_host": True}
    check_agreement(rank_pools, spec, world_size, live_optimizer)


partial_shares = st.one_of(st.tuples(st.just("fraction"), st.sampled_from([0.2, 0.5, 0.8])),
                           st.tuples(st.just("budget"), st.integers(0, 3000)))


@settings(max_examples=10)
@given(spec=specs, world_size=st.sampled_from(WORLD_SIZES), live_optimizer=st.booleans(), share=partial_shares)
def test_fractional_parameter_offload_is_predicted_exactly(rank_pools: RankPoolRegistry, spec: dict, world_size: int,
                                                           live_optimizer: bool, share: tuple) -> None:
    """``offload_params=<fraction>`` / ``offload_device_budget=``: the plan of that fraction or
    budget moves the same units as the engine, each kind's bytes on its tier."""
    spec = {**spec, "stage": 3, "offload": False, "partial": share}
    check_agreement(rank_pools, spec, world_size, live_optimizer)


@settings(max_examples=8)
@given(spec=specs, world_size=st.sampled_from(WORLD_SIZES), live_optimizer=st.booleans())
def test_parameters_on_disk_are_predicted_exactly(rank_pools: RankPoolRegistry, spec: dict, world_size: int,
                                                  live_optimizer: bool) -> None:
    """``offload_params="disk"``: zero3-offload-params-disk's bytes, the parameter shards and the
    optimizer's in files, the gradients on the host, none on the device."""
    spec = {**spec, "stage": 3, "offload": True, "params_on_host": True, "disk": True}
    check_agreement(rank_pools, spec, world_size, live_optimizer)


@settings(max_examples=6)
@given(spec=specs, live_optimizer=st.booleans())
def test_hybrid_sharding_is_predicted_exactly(rank_pools: RankPoolRegistry, spec: dict, live_optimizer: bool) -> None:
    """``EngineOptions(shard_group_size=2)`` at 4 ranks: stages 1-3 laid out over the group of 2
    (stage 0 over all 4, as the engine ignores the group size there)."""
    spec = {**spec, "offload": spec["offload"] and spec["stage"] == 3, "shard_group_size": 2}
    check_agreement(rank_pools, spec, 4, live_optimizer)


def test_padding_makes_the_exact_count_differ_from_ceil_psi_over_n(rank_pools: RankPoolRegistry) -> None:
    spec = dict(vocab=7, dim=5, hidden=[3, 11], bias=True, tied=False, frozen=None, empty=False, stage=2,
                offload=False, optimizer="adamw", precision="fp32", bucket_mb=0.0002)
    (report, *_) = rank_pools.get(4).run(engine_report_after_step, spec)
    psi = sum(p.numel() for p in random_net(spec).parameters())
    assert report["grads"] == predicted(spec, 4, False)["grads"] > 4 * -(-psi // 4)


@pytest.mark.parametrize("stage", [0, 3])
def test_pure_bf16_model_trains_with_8_bytes_per_parameter(rank_pools: RankPoolRegistry, stage: int) -> None:
    """bf16 params (2), grads (2) and AdamW state (2 + 2), no fp32 master, as the estimator says."""
    spec = dict(vocab=11, dim=8, hidden=[16], bias=True, tied=False, frozen=None, empty=False, stage=stage,
                offload=False, optimizer="adamw", precision="pure-bf16", bucket_mb=25.0)
    reports = rank_pools.get(2).run(engine_report_after_step, spec)
    psi = sum(p.numel() for p in random_net(spec).parameters())  # 11·8 + 8·16 + 16 + 16·8 + 8 + 8·11 + 11 = 467
    expected = predicted(spec, 2, False)
    assert {key: reports[0][key] for key in expected} == expected  # rank 0 holds no padding
    padded = psi + 1  # one flat bucket padded to a multiple of N = 2
    per_rank = [padded * 2, padded * 2, psi * 4] if stage == 0 else [padded, padded, padded * 2]
    assert [reports[0][key] for key in ("params", "grads", "optimizer_states")] == per_rank


def test_optimizer_name_maps_torch_optimizers():
    params = [nn.Parameter(torch.zeros(2))]
    assert optimizer_name(torch.optim.AdamW(params)) == "adamw"
    assert optimizer_name(torch.optim.Adam(params)) == "adam"
    assert optimizer_name(torch.optim.SGD(params, lr=0.1)) == "sgd"
    assert optimizer_name(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == "sgd-momentum"
    with pytest.raises(EstimatorInputError, match="does not model Adagrad"):
        optimizer_name(torch.optim.Adagrad(params))
    with pytest.raises(EstimatorInputError, match="amsgrad"):
        optimizer_name(torch.optim.Adam(params, amsgrad=True))


@pytest.mark.parametrize("share", [("fraction", 0.5), ("budget", 3000)], ids=["fraction", "budget"])
def test_a_fractional_plan_splits_the_states_as_the_engine_does(rank_pools: RankPoolRegistry, share: tuple) -> None:
    """A model whose fractional plan keeps some units on each tier, at N = 2."""
    spec = dict(vocab=17, dim=12, hidden=[12, 12], bias=True, tied=False, frozen=1, empty=False, stage=3,
                offload=False, optimizer="adamw", precision="bf16", bucket_mb=25.0, partial=share)
    expected = predicted(spec, 2, live_optimizer=False)
    assert expected["optimizer_states"] and expected["host_optimizer_states"] and expected["host_params"]
    check_agreement(rank_pools, spec, 2, live_optimizer=False)


def engine_peak_buffers(spec: dict) -> list[int]:
    """Rank worker: stage 3 (``reshard_after_forward`` as the spec says), two steps; the engine's
    tracked peak of transient buffers in each (the second forward prefetches)."""
    import shardengine as se

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Net(spec["vocab"], spec["dim"], spec["hidden"], buffer=False)
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters()), stage=3, param_dtype="bf16",
                                reshard_after_forward=spec["reshard_after_forward"],
                                step_in_backward=spec.get("in_backward", False),
                                max_inflight_buckets=spec.get("in_flight", 1))
    peaks = []
    for _ in range(2):
        ids = torch.randint(spec["vocab"], (2, 3))
        model.reset_comm_stats()  # restarts the peak
        F.cross_entropy(model(ids).float().reshape(-1, spec["vocab"]), ids.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(model.memory_report().peak_comm_buffers)
    return peaks


def predicted_engine_buffers(spec: dict, world_size: int) -> int:
    """The exact model's stage-3 buffers alive with the activations (its ``engine_buffers``)."""
    from memory_estimator.plan.memory import _engine_terms
    from memory_estimator.terms.model_states import plan_spec

    net = Net(spec["vocab"], spec["dim"], spec["hidden"], buffer=False)
    result = estimate(module=net, world_size=world_size, precision="bf16", optimizer="adamw",
                      engine_options=EngineOptions(reshard_after_forward=spec["reshard_after_forward"],
                                                   max_inflight_buckets=spec.get("in_flight", 1)),
                      device_memory_bytes=10**15)
    terms = _engine_terms(plan_spec("zero3"), result.stats, result.setup, result.engine_model, result.exact_engine)
    return terms.forward["engine_buffers"]


# Equal blocks whose root (embedding + head) is smaller than one: the block backward reaches first
# is the largest, where the estimate is exact (a bound otherwise). One block alone: nothing to
# prefetch, and only the model without resharding is counted exactly there.
STAGE3_BUFFERS = [(hidden, raf, world) for hidden, rafs in (([8] * 4, (True, False)), ([], (False,)))
                  for raf in rafs for world in (2, 3)]


@pytest.mark.parametrize("hidden,reshard_after_forward,world_size", STAGE3_BUFFERS)
def test_stage3_buffers_equal_the_engines_tracked_peak(rank_pools: RankPoolRegistry, hidden: list[int],
                                                       reshard_after_forward: bool, world_size: int) -> None:
    """Stage 3's gathered units and gradient buffers: the estimate equals ``peak_comm_buffers`` on
    every rank, both steps, with and without resharding after forward."""
    spec = dict(vocab=3, dim=8, hidden=hidden, reshard_after_forward=reshard_after_forward)
    expected = predicted_engine_buffers(spec, world_size)
    peaks = rank_pools.get(world_size).run(engine_peak_buffers, spec)
    assert peaks == [[expected, expected]] * world_size


# The step inside backward adds no buffer to the backward's; with ``max_inflight_buckets=2`` a
# second unit's reduction is beside the activations.
STAGE3_OPTIONS = [(2, False, dict(in_backward=True)), (3, True, dict(in_backward=True)),
                  (2, True, dict(in_flight=2)), (3, False, dict(in_flight=2))]


@pytest.mark.parametrize("world_size, reshard_after_forward, options", STAGE3_OPTIONS)
def test_stage3_buffers_with_the_step_inside_backward_or_two_in_flight(
        rank_pools: RankPoolRegistry, world_size: int, reshard_after_forward: bool, options: dict) -> None:
    spec = dict(vocab=3, dim=8, hidden=[8] * 4, reshard_after_forward=reshard_after_forward, **options)
    expected = predicted_engine_buffers(spec, world_size)
    peaks = rank_pools.get(world_size).run(engine_peak_buffers, spec)
    assert peaks == [[expected, expected]] * world_size
