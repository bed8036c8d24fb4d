"""Engine models: each engine's documented buffers as named terms, and FSDP2 against a real run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from memory_estimator import estimate
from memory_estimator.engines import DeepSpeedKnobs
from memory_estimator.errors import EstimatorInputError
from memory_estimator.terms.overheads import Overheads
from rank_pool import RankPoolRegistry
from toy_models import Net

LLAMA_7B = Path(__file__).resolve().parents[1] / "configs" / "llama-2-7b.json"
PSI = 6_738_415_616
QUIET = Overheads(cuda_context_bytes=0, fragmentation_fraction=0.0, logits_in_overhead=False, nccl_bytes=0)


def run(engine: str, n: int = 8, **kwargs):
    return estimate(config=LLAMA_7B, world_size=n, engine=engine, overheads=QUIET, seq_len=1024,
                    device_memory_bytes=10**15, **kwargs)


def test_ddp_buckets_are_a_second_gradient_copy_unless_they_are_the_gradients():
    plain = run("ddp", precision="fp32").plan("ddp")
    assert plain.buffers["ddp_gradient_buckets"] == 4 * PSI
    assert plain.peak_moment == "step" and plain.grads == 4 * PSI   # param.grad exists from backward to the step
    viewed = run("ddp", precision="fp32", gradient_as_bucket_view=True).plan("ddp")
    assert "ddp_gradient_buckets" not in viewed.buffers and viewed.total < plain.total
    single = run("ddp", n=1, precision="fp32").plan("ddp")        # one process trains without DDP
    assert "ddp_gradient_buckets" not in single.buffers


def test_ddp_gradients_are_not_alive_at_the_end_of_forward():
    result = estimate(config=LLAMA_7B, world_size=2, engine="ddp", precision="fp32", optimizer="sgd",
                      micro_batch=16, seq_len=4096, overheads=QUIET, device_memory_bytes=10**15)
    plan = result.plan("ddp")
    assert plan.peak_moment == "forward" and plan.grads == 0 and plan.activations > 0


def test_zero_redundancy_optimizer_holds_at_least_the_largest_parameter():
    tiny_n = run("ddp", n=10**5, precision="fp32").plan("zero1")
    assert tiny_n.optimizer_states == 8 * 32000 * 4096  # the embedding, the largest tensor


def test_optimizer_step_temporaries_follow_the_implementation():
    steps = {impl: run("ddp", n=2, precision="fp32", optimizer_impl=impl).plan("ddp").buffers.get(
        "optimizer_step_temporaries", 0) for impl in ("foreach", "plain", "fused")}
    assert steps["foreach"] == 4 * PSI                      # one fp32 sqrt list over every parameter
    assert steps["plain"] == 2 * 4 * 32000 * 4096            # sqrt and quotient of the largest tensor
    assert steps["fused"] == 0


def test_fsdp2_mixed_precision_shards_are_the_fp32_masters():
    plan = run("fsdp2", precision="bf16").plan("zero3")
    shard = -(-PSI // 8)
    assert (plan.params, plan.optimizer_states) == (4 * shard, 8 * shard)
    pure = run("fsdp2", precision="pure-bf16").plan("zero3")
    assert (pure.params, pure.optimizer_states) == (2 * shard, 4 * shard)


def test_fsdp2_keeps_the_root_gathered_and_reshard_false_keeps_everything():
    zero3 = run("fsdp2", precision="bf16", micro_batch=8)
    gathered = zero3.plan("zero3").buffers["all_gather_buffers"]
    block, root = 202_383_360, 2 * 32000 * 4096 + 4096
    assert gathered == 2 * (root + 3 * block)    # root + running group, its retained output, one prefetched
    assert zero3.plan("zero2").buffers["all_gather_buffers"] == 2 * PSI
    fp32_reduce = run("fsdp2", precision="bf16", micro_batch=8, reduce_dtype="fp32").plan("zero3")
    assert fp32_reduce.buffers["reduce_scatter_buffers"] == (2 + 2 * 4) * block


def test_fsdp2_cpu_offload_keeps_states_on_the_host():
    plan = run("fsdp2", precision="bf16").plan("zero3-offload-params")
    shard = -(-PSI // 8)
    assert (plan.params, plan.grads, plan.optimizer_states) == (0, 0, 0)
    assert plan.host_bytes == (4 + 4 + 8) * shard
    # one group's host shard copied in (fp32) and cast to bf16 before its all-gather
    block = 202_383_360
    assert plan.buffers["offload_copy_buffers"] == -(-(4 + 2) * block // 8)
    pure = run("fsdp2", precision="pure-bf16").plan("zero3-offload-params")
    assert pure.buffers["offload_copy_buffers"] == -(-2 * block // 8)      # no cast: already param_dtype
    assert "offload_copy_buffers" not in run("fsdp2", precision="bf16").plan("zero3").buffers


def test_deepspeed_stage3_buffers_from_its_knobs():
    knobs = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 10**7, "stage3_prefetch_bucket_size": 10**6,
                                   "sub_group_size": 10**8, "stage3_max_reuse_distance": 0}, "bf16": {"enabled": True}}
    result = run("deepspeed", deepspeed_config=knobs)
    assert result.setup.precision == "bf16"
    zero3 = result.plan("zero3")
    assert zero3.buffers["reduce_bucket"] == 2 * 10**7
    assert zero3.buffers["gathered_parameters"] == 2 * (32000 * 4096 + 10**6)
    # parameters reused within stage3_max_reuse_distance stay gathered: the forward's last half of it
    reused = run("deepspeed", deepspeed_config={**knobs, "zero_optimization": {
        **knobs["zero_optimization"], "stage3_max_reuse_distance": 4 * 10**8}}).plan("zero3")
    assert reused.buffers["gathered_parameters"] == 2 * (32000 * 4096 + 10**6 + 2 * 10**8)
    # a live budget below the largest tensor (the head) limits the prefetch, not the head's own fetch
    tight = run("deepspeed", deepspeed_config={**knobs, "zero_optimization": {
        **knobs["zero_optimization"], "stage3_max_live_parameters": 10**7}}).plan("zero3")
    assert tight.buffers["gathered_parameters"] == 2 * 32000 * 4096
    # At the step one sub-group's 16-bit gradients are flattened and cast to fp32.
    from memory_estimator.engines import DeepSpeedZero, EngineContext
    from memory_estimator.terms.model_states import plan_spec
    engine = DeepSpeedZero(DeepSpeedKnobs.from_config(knobs))
    context = EngineContext(result.stats, 8, result.setup.policy, "adamw", "fused")
    assert engine.terms(plan_spec("zero3"), context).step == {"fp32_grad_partition": (2 + 4) * 10**8}


def test_deepspeed_offload_params_moves_the_partitions_to_the_host():
    result = run("deepspeed", precision="bf16")
    shard = -(-PSI // 8)
    offload = result.plan("zero3-offload")
    assert offload.optimizer_states == offload.grads == 0
    assert offload.host_bytes == (12 + 4) * shard  # masters, Adam, fp32 gradient partitions
    zero_offload = result.plan("zero2-offload")     # ZeRO-Offload: stage 2 with the step on the host
    assert (zero_offload.params, zero_offload.grads) == (2 * PSI, 0)
    infinity = result.plan("zero3-offload-params")
    assert (infinity.params, infinity.grads) == (0, 0) and infinity.host_bytes == (2 + 12 + 4) * shard


def test_deepspeed_offload_params_fetch_copies_the_heads_host_partition_before_its_logits():
    # all_gather_coalesced gathers from param.ds_tensor.to(device): with offload_param each fetch
    # holds a device copy of the host partition; the head's is the last of forward, before its logits.
    result = run("deepspeed", precision="bf16")
    infinity = result.plan("zero3-offload-params")
    copy = 2 * -(-32000 * 4096 // 8)                 # bf16, the vocab x hidden head over 8 ranks
    assert infinity.buffers["offloaded_partition_copy"] == copy
    assert infinity.peak_moment == "head fetch"      # QUIET counts no logits: the fetch is the peak
    assert infinity.moments["head fetch"] - infinity.moments["forward"] == copy
    assert "offloaded_partition_copy" not in result.plan("zero3").buffers   # partitions on the device
    lora = run("deepspeed", precision="bf16", lora_rank=8).plan("zero3-offload-params")
    assert lora.buffers["offloaded_partition_copy"] == copy                   # the frozen head's partition
    with_logits = estimate(config=LLAMA_7B, world_size=8, engine="deepspeed", precision="bf16", seq_len=1024,
                           micro_batch=64, device_memory_bytes=10**15,
                           overheads=Overheads(cuda_context_bytes=0, fragmentation_fraction=0.0, nccl_bytes=0))
    assert with_logits.plan("zero3-offload-params").peak_moment == "forward"  # logits larger than the copy


def test_deepspeed_stage2_double_buffers_with_overlap_comm():
    bf16 = {"bf16": {"enabled": True}}
    single = run("deepspeed", micro_batch=16,
                 deepspeed_config={**bf16, "zero_optimization": {"reduce_bucket_size": 10**8}})
    double = run("deepspeed", micro_batch=16,
                 deepspeed_config={**bf16, "zero_optimization": {"reduce_bucket_size": 10**8, "overlap_comm": True}})
    assert single.plan("zero2").buffers["contiguous_gradient_buckets"] == 2 * 10**8
    assert double.plan("zero2").buffers["contiguous_gradient_buckets"] == 2 * 2 * 10**8


def test_deepspeed_config_errors_are_one_line():
    with pytest.raises(EstimatorInputError, match="reduce_bucket_size must be a non-negative number"):
        DeepSpeedKnobs.from_config({"zero_optimization": {"reduce_bucket_size": "big"}})
    with pytest.raises(EstimatorInputError, match="DeepSpeed config not found"):
        DeepSpeedKnobs.from_config("/no/such/ds.json")


def test_autocast_keeps_fp32_states_and_a_low_precision_weight_cache():
    amp = estimate(config=LLAMA_7B, world_size=8, amp="bf16", overheads=QUIET, device_memory_bytes=10**15,
                   seq_len=1024, micro_batch=4)
    assert amp.setup.policy.name == "amp-bf16"
    zero3 = amp.plan("zero3")
    assert zero3.buffers["autocast_weight_cache"] == 2 * PSI
    assert zero3.optimizer_states == 8 * -(-PSI // 8)   # fp32 Adam over the fp32 weights, no master


# ---------------------------------------------------------------------- FSDP2, measured

class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def fsdp2_state_bytes(precision: str) -> dict:
    """Rank worker: fully_shard each layer and the root, one AdamW step, the bytes FSDP2 holds."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Stack()
    if precision == "pure-bf16":
        model = model.to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64, dtype=torch.bfloat16 if precision == "pure-bf16" else torch.float32)).float().sum().backward()
    grads = sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters())
    optimizer.step()
    params = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    states = sum(t.to_local().numel() * t.element_size() for s in optimizer.state.values()
                 for k, t in s.items() if k != "step")
    return {"params": params, "grads": grads, "optimizer_states": states}


@pytest.mark.parametrize("precision", ["bf16", "pure-bf16"])
def test_fsdp2_sharded_states_match_a_real_fully_shard(rank_pools: RankPoolRegistry, precision: str) -> None:
    measured = rank_pools.get(2).run(fsdp2_state_bytes, precision)
    predicted = estimate(module=Stack, world_size=2, engine="fsdp2", precision=precision,
                         device_memory_bytes=10**12, overheads=QUIET).plan("zero3")
    psi = 4 * (64 * 64 + 64)
    element = 4 if precision == "bf16" else 2  # fp32 masters under the policy, else the bf16 model itself
    for rank in measured:
        assert rank == {"params": element * psi // 2, "grads": element * psi // 2,
                        "optimizer_states": 2 * element * psi // 2}
    assert (predicted.params, predicted.optimizer_states) == (element * psi // 2, 2 * element * psi // 2)


def test_shardengine_stage3_without_resharding_counts_every_unit_gathered():
    """``reshard_after_forward=False``: with the activations every unit is gathered but the block
    backward frees first (before its reduction's buffers exist), where resharding counts the root
    and 1 + prefetch blocks: the estimate grows by exactly the blocks not counted before, less
    that one. The late buffers and the other stages do not change."""
    from memory_estimator.engines.shardengine_exact import EngineOptions, exact_engine_model
    from memory_estimator.terms.model_states import plan_spec

    net = Net(vocab=3, dim=8, hidden=[8] * 6, buffer=False)  # 7 blocks of 72 elements, a root of 52
    block, root, grad = 72, 52, 72 + 36                        # a block's padded and shard gradient at N = 2

    def terms(plan: str, reshard: bool, prefetch: int = 1):
        model = exact_engine_model(net, 2, EngineOptions(reshard_after_forward=reshard))
        return model.terms(plan_spec(plan), "bf16", "adamw", "plain", prefetch)

    for prefetch in (0, 1, 2):
        kept, resharded = terms("zero3", False, prefetch), terms("zero3", True, prefetch)
        assert kept.forward["engine_buffers"] == 2 * (root + 6 * block) + 2 * grad
        uncounted = 7 - (1 + prefetch) - 1
        assert kept.forward["engine_buffers"] - resharded.forward["engine_buffers"] == 2 * uncounted * block
        assert kept.step == resharded.step
    for plan in ("ddp", "zero1", "zero2"):
        assert terms(plan, False) == terms(plan, True)

    def zero3_total(**options) -> int:
        return estimate(module=net, world_size=2, device_memory_bytes=10**12, overheads=QUIET,
                        **options).plan("zero3").total

    kept = zero3_total(reshard_after_forward=False)  # the request's keyword plans the module the same way
    assert kept == zero3_total(engine_options=EngineOptions(reshard_after_forward=False)) > zero3_total()
    with pytest.raises(EstimatorInputError, match="give EngineOptions"):
        zero3_total(reshard_after_forward=False, engine_options=EngineOptions())


@pytest.mark.parametrize("implementation", ["foreach", "plain"])
def test_shardengine_steps_one_bucket_at_a_time(implementation: str):
    """shardengine steps torch's optimizers one flat bucket at a time, so the fp32 master
    gradient and the temporaries of its step are one bucket's worth, not the shard's: under
    foreach at most FSDP2's (whose foreach step spans the shard). Under the for-loop FSDP2 has
    no fp32 gradient copy to make (its gradients are fp32 already, held as a state), so there
    the bound is one bucket's gradient copy plus the largest piece's temporaries."""
    from memory_estimator.plan.memory import _engine_terms
    from memory_estimator.terms.model_states import plan_spec

    def step_bytes(engine: str, plan: str) -> dict[str, int]:
        result = run(engine, precision="bf16", optimizer_impl=implementation)
        return _engine_terms(plan_spec(plan), result.stats, result.setup, result.engine_model, None).step

    embedding = 32000 * 4096 // 8  # alone in its bucket (larger than 25 MiB): the largest per rank
    for plan in ("zero1", "zero2", "zero3"):
        step = step_bytes("shardengine", plan)
        if plan != "zero3":
            assert step["fp32_master_grads"] == 4 * embedding
        else:  # the largest unit's shard: a decoder block
            assert step["fp32_master_grads"] == 4 * 202_383_360 // 8
        per_call = step["fp32_master_grads"] // 4
        temporaries = (1 if implementation == "foreach" else 2) * 4 * per_call
        assert step["optimizer_step_temporaries"] == temporaries
        if implementation == "foreach":
            assert sum(step.values()) <= sum(step_bytes("fsdp2", "zero3").values()), plan
