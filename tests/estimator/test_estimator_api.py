"""estimate(): plans, recommendation, micro-batch search, suggestions, devices and bad input."""
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from memory_estimator import EstimatorInputError, estimate
from memory_estimator.hardware.devices import CATALOG, catalog_device, resolve_device
from memory_estimator.terms.overheads import Overheads
from memory_estimator.byte_units import GiB, parse_bytes

LLAMA_7B = Path(__file__).resolve().parents[1] / "configs" / "llama-2-7b.json"
NO_OVERHEAD = Overheads(cuda_context_bytes=0, fragmentation_fraction=0.0, logits_in_overhead=False, nccl_bytes=0)


def test_zero_paper_numbers_through_the_public_api():
    result = estimate(params=7.5e9, world_size=64, precision="fp16", optimizer="adam", device_memory_bytes="80GB")
    states = [p.params + p.grads + p.optimizer_states for p in result.plans]
    # The paper's stages 0-2; at stage 3 the paper's (2 + 2 + K)Ψ/N less the fp16 shard that
    # shardengine does not keep beside its fp32 master (gathers cast the master), as FSDP2.
    assert states[:4] == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000 - 2 * 7_500_000_000 // 64]
    assert result.plan("zero3-offload").host_optimizer_states == 12 * 7_500_000_000 // 64


def test_total_is_the_sum_of_the_terms_at_the_peak_moment():
    result = estimate(config=LLAMA_7B, world_size=8, micro_batch=1, seq_len=4096, device="A100-80GB")
    for plan, payload in zip(result.plans, result.to_json_dict()["plans"]):
        terms = payload["per_rank_bytes"]
        assert terms["total"] == sum(v for k, v in terms.items() if k != "total") == max(plan.moments.values())
        assert terms["total"] == plan.moments[plan.peak_moment]
        # Activations are alive at the end of forward and freed by the optimizer step.
        assert (terms["activations"] > 0) == (plan.peak_moment == "forward")
    # Stage 0 steps one bucket at a time: its fp32 master gradients no longer peak past forward.
    assert result.plan("ddp").peak_moment == "forward" and result.plan("zero3").peak_moment == "forward"


def test_recommended_is_least_sharded_fit_and_max_micro_batch_is_tight():
    result = estimate(config=LLAMA_7B, world_size=8, micro_batch=1, seq_len=4096, device="A100-80GB")
    fits = [plan.fits for plan in result.plans]
    assert result.recommended == result.plans[fits.index(True)].name
    best = result.max_micro_batch
    at_best = estimate(config=LLAMA_7B, world_size=8, micro_batch=best, seq_len=4096, device="A100-80GB")
    one_more = estimate(config=LLAMA_7B, world_size=8, micro_batch=best + 1, seq_len=4096, device="A100-80GB")
    assert at_best.plan(result.recommended).fits and not one_more.plan(result.recommended).fits


def test_nothing_fits_says_what_would():
    result = estimate(config=LLAMA_7B, world_size=1, micro_batch=8, seq_len=4096, device="RTX4090")
    assert result.recommended is None and result.max_micro_batch is None
    assert not any(plan.fits for plan in result.plans)
    assert any(s.startswith("full checkpointing") for s in result.suggestions)
    for advice in result.suggestions:  # every suggestion is checked to fit, not guessed
        label, verdict = advice.split(": ", 1)
        plan, n = verdict.split(" fits")[0], int(verdict.rsplit(" ", 1)[1])
        changes = {"world_size": n}
        if "checkpointing" in label:
            changes["checkpointing"] = "full"
        if "micro-batch" in label:
            changes["micro_batch"] = int(label.rsplit(" ", 1)[1])
        kwargs = {"config": LLAMA_7B, "micro_batch": 8, "seq_len": 4096, "device": "RTX4090", **changes}
        assert estimate(**kwargs).plan(plan).fits, advice


def test_parameter_offload_fits_where_zero3_needs_more_ranks():
    # 14B: even zero3-offload's device gradients (2 B/param) exceed a 24 GB card at N = 1; with
    # the parameter and gradient shards on the host too the device holds no model states.
    result = estimate(params=1.4e10, largest_layer=2e8, world_size=1, device="RTX4090", overheads=NO_OVERHEAD)
    assert not result.plan("zero3-offload").fits
    assert result.recommended == "zero3-offload-params"
    plan = result.plan("zero3-offload-params")
    assert plan.params == plan.grads == plan.optimizer_states == 0
    # the fp32 master is then the only parameter shard: 4 B/param under host_params, Adam's 8 B beside it
    assert (plan.host_params, plan.host_grads, plan.host_optimizer_states) == \
        (4 * 14 * 10**9, 2 * 14 * 10**9, 8 * 14 * 10**9)


def test_params_only_without_architecture_still_gives_valid_json():
    result = estimate(params=1e9, device="A100-80GB")
    payload = json.loads(json.dumps(result.to_json_dict()))
    assert payload["max_micro_batch"] is None and payload["recommended"] == "ddp"
    assert result.activation_source == "not estimated"


def test_overheads_are_configurable_terms():
    base = estimate(config=LLAMA_7B, world_size=8, device="H100-80GB", overheads=NO_OVERHEAD)
    assert all(plan.overhead == 0 for plan in base.plans)
    context_only = estimate(config=LLAMA_7B, world_size=8, device="H100-80GB",
                            overheads=Overheads(cuda_context_bytes=GiB, fragmentation_fraction=0.0,
                                                logits_in_overhead=False, nccl_bytes=0))
    assert all(plan.overhead == GiB for plan in context_only.plans)
    with_logits = estimate(config=LLAMA_7B, world_size=8, device="H100-80GB", seq_len=1024,
                           overheads=Overheads(0, 0.0, True, nccl_bytes=0))
    assert with_logits.plan("zero3").overhead == 14 * 1024 * 32000


def test_cuda_context_follows_the_generation_and_module_loading():
    lazy = estimate(params=1e8, device="V100-16GB").plans[0].buffers["cuda_context"]
    eager = estimate(params=1e8, device="V100-16GB", module_loading="eager").plans[0].buffers["cuda_context"]
    assert (lazy, eager) == (512 * 2**20, 1343 * 2**20)
    assert "cuda_context" not in estimate(params=1e8, device="cpu", device_memory_bytes="64GiB").plans[0].buffers


def test_nccl_buffers_grow_with_peers_then_stop():
    nccl = [estimate(params=1e8, world_size=n, device="A100-80GB").plans[0].buffers.get("nccl_buffers", 0)
            for n in (1, 2, 3, 5, 64)]
    assert nccl[0] == 0 and nccl[1] < nccl[2] < nccl[3] == nccl[4]
    pcie = estimate(params=1e8, world_size=5, device="RTX4090").plans[0].buffers["nccl_buffers"]
    assert pcie < nccl[3]


def test_nvls_buffers_on_nvswitch_hopper_and_one_set_per_communicator():
    MiB = 2**20

    def nccl(device, n, engine="shardengine"):
        return estimate(params=1e8, world_size=n, device=device, engine=engine).plans[0].buffers["nccl_buffers"]

    rings = 16 * 4 * 10 * MiB                                 # channels x connections x FIFOs
    assert nccl("H100-80GB", 8) == rings + 8 * 288 * MiB      # NVLS: 288 MiB per rank of the node
    assert nccl("H100-80GB", 64) == nccl("H100-80GB", 8)      # the node's ranks, not the world's
    assert nccl("H100-80GB", 2) == 16 * 1 * 10 * MiB          # two GPUs: no NVLS
    assert nccl("H100-94GB", 8) == nccl("A100-80GB", 8) == rings   # no NVSwitch, no NVLS
    assert nccl("H100-80GB", 8, "deepspeed") == 2 * nccl("H100-80GB", 8)   # the world group and its clone
    term = next(t for t in estimate(params=1e8, world_size=8, device="H100-80GB").plans[0].confidence.terms
                if t.term == "nccl_buffers")
    assert (term.basis, term.low, term.high) == ("assumption", rings, rings + 8 * 288 * MiB)


def test_stage3_working_set_follows_largest_unit_and_prefetch():
    # fp32 SGD: no step buffers, so the peak is the end of forward with the gathered units.
    common = dict(params=1e9, largest_layer=1e7, device="A100-80GB", bucket_bytes=0, precision="fp32",
                  optimizer="sgd")
    plans = {depth: estimate(prefetch_depth=depth, **common).plan("zero3") for depth in (0, 2)}
    assert plans[0].working_set == 4 * 10**7 and plans[2].working_set == 3 * 4 * 10**7
    # One unit (the whole model, when the unit size is unknown) is gathered once, prefetch or not.
    whole = estimate(**{**common, "params": 1e6, "largest_layer": None, "prefetch_depth": 2}).plan("zero3")
    assert whole.working_set == 4 * 10**6


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 512), st.sampled_from(["ddp", "zero1", "zero2", "zero3", "zero3-offload"]))
def test_per_rank_totals_never_grow_with_world_size(n, plan):
    # NCCL's buffers do grow with peers (test_nccl_buffers_grow_with_peers_then_stop); all else shrinks.
    no_nccl = Overheads(nccl_bytes=0)
    smaller = estimate(config=LLAMA_7B, world_size=n, device="A100-80GB", overheads=no_nccl).plan(plan).total
    larger = estimate(config=LLAMA_7B, world_size=n + 1, device="A100-80GB", overheads=no_nccl).plan(plan).total
    assert larger <= smaller


def test_device_catalog_and_memory_units():
    assert {"A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "L40S", "RTX3090", "RTX4090",
            "V100-16GB", "V100-32GB", "MI300X"} <= set(CATALOG)
    assert catalog_device("a100 80gb").name == "A100-80GB"
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("24GB") == 24 * 10**9
    assert resolve_device("RTX4090", "20GiB").memory_bytes == 20 * 2**30
    assert resolve_device("this-machine").memory_bytes > 0
    with pytest.raises(EstimatorInputError, match="did you mean H100-80GB"):
        catalog_device("H100-80")
    with pytest.raises(EstimatorInputError, match="unknown memory unit"):
        parse_bytes("24 parsecs")


@pytest.mark.parametrize("kwargs,message", [
    ({"params": -5}, "params must be at least 1"),
    ({"params": 1e30}, "implausibly large"),
    ({"params": 1e9, "world_size": 0}, "world size must be at least 1"),
    ({"params": 1e9, "micro_batch": 2.5}, "micro-batch must be a whole number"),
    ({"params": 1e9, "precision": "int4"}, "unknown precision"),
    ({"params": 1e9, "precision": "bf16", "amp": "fp16"}, "autocast .* runs over fp32 weights"),
    ({"params": 1e9, "amp": "fp8"}, "unknown autocast dtype"),
    ({"params": 1e9, "engine": "megatron"}, "unknown engine 'megatron'"),
    ({"params": 1e9, "engine": "deepspeed", "precision": "pure-bf16"}, "DeepSpeed keeps fp32 master"),
    ({"params": 1e9, "deepspeed_config": {}}, "applies to --engine deepspeed only"),
    ({"params": 1e9, "optimizer_impl": "turbo"}, "unknown optimizer implementation"),
    ({"params": 1e9, "checkpointing": "every-k:0"}, "K must be a whole number"),
    ({"params": 1e9, "safety_margin": 1.5}, "safety margin must be a number in"),
    ({"params": 1e9, "config": LLAMA_7B}, "give exactly one of params, config or module"),
    ({}, "give exactly one of params, config or module"),
    ({"params": 1e9, "hidden": 4096}, "missing layers, heads, vocab"),
    ({"params": 1e9, "device": None, "device_memory_bytes": "-3GB"}, "memory size must be positive"),
])
def test_bad_input_is_a_one_line_error(kwargs, message):
    with pytest.raises(EstimatorInputError, match=message) as caught:
        estimate(**kwargs)
    assert "\n" not in str(caught.value)


@given(threshold=st.integers(1, 300), low=st.integers(1, 40), limit=st.integers(40, 256))
def test_fitting_searches_agree_with_brute_force(threshold, low, limit):
    from memory_estimator.plan.memory import largest_fitting, smallest_fitting
    below = [x for x in range(low, limit + 1) if x < threshold]   # fits, then not
    above = [x for x in range(low, limit + 1) if x >= threshold]  # not, then fits
    assert largest_fitting(lambda x: x < threshold, low, limit) == (max(below) if below else None)
    assert smallest_fitting(lambda x: x >= threshold, low, limit) == (min(above) if above else None)
