"""Each fine-tuning term of the estimator against its formula or the library that defines it.

LoRA counts against PEFT on a meta-built model; the frozen base, NF4 storage, the loss
variants, fused norms, compile, frozen projections' inputs, paged and Muon optimizers,
accumulation and the optimizer in backward against the formulas of ``finetune.py``,
``kernels.py`` and ``activations.py``; the Qwen3-MoE config transformers 5 writes.
All analytic: no process is spawned.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from memory_estimator import EstimatorInputError, estimate
from memory_estimator.terms.activations import ActivationInputs, activation_profile, layer_bytes
from memory_estimator.terms.adapters import BASE_DTYPES, Adapters, frozen_numel
from memory_estimator.model.hf_config import stats_from_config
from memory_estimator.terms.kernels import Kernels, loss_bytes
from memory_estimator.terms.optimizers import optimizer_name

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LLAMA = CONFIGS / "llama-2-7b.json"
BIG = 10**15


def small_llama() -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 101, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj",
                                                            "gate_proj", "up_proj", "down_proj"]])
def test_lora_count_equals_peft_on_the_meta_model(targets):
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = small_llama()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    expected = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    stats = stats_from_config(config)
    adapters = Adapters(lora_rank=8, lora_targets=tuple(targets))
    assert adapters.trainable(stats.architecture) == expected
    # the adapters come beside the base: every one of its weights stays, frozen
    assert frozen_numel(stats, adapters, expected) == sum(p.numel() for p in wrapped.parameters()) - expected


def test_frozen_base_costs_weights_only_and_adapters_their_full_state():
    stats = stats_from_config(json.loads(LLAMA.read_text()))
    result = estimate(config=LLAMA, lora_rank=16, world_size=4, precision="bf16", device_memory_bytes=BIG,
                      engine="ddp")
    lora = Adapters(lora_rank=16).trainable(stats.architecture)
    frozen = stats.params                                 # LoRA adds its adapters beside the base
    ddp = result.plan("ddp")
    assert ddp.params == 2 * frozen + 2 * lora            # bf16 weights, frozen or not
    assert ddp.optimizer_states == (4 + 8) * lora         # fp32 master + AdamW's two moments, adapters only
    fsdp = estimate(config=LLAMA, lora_rank=16, world_size=4, precision="bf16", device_memory_bytes=BIG,
                    engine="fsdp2")
    # FSDP2's fp32 trainable shards plus the frozen bf16 base, both sharded by 4 (zero2 too:
    # FSDP2 stores shards and only keeps the gathered copy alive longer).
    for plan in ("zero2", "zero3"):
        assert fsdp.plan(plan).params == 4 * math.ceil(lora / 4) + math.ceil(2 * frozen / 4)
    full_gather = estimate(config=LLAMA, world_size=4, precision="bf16", device_memory_bytes=BIG, engine="fsdp2")
    gathered = fsdp.plan("zero2").buffers["all_gather_buffers"]
    stored_share = (2 * lora + 2 * frozen) / (2 * stats.params)   # the adapters are gathered with their unit
    assert gathered == math.ceil(full_gather.plan("zero2").buffers["all_gather_buffers"] * stored_share)


def test_nf4_stores_block_linears_at_4_127_bits_and_the_rest_in_16():
    config = json.loads(LLAMA.read_text())
    stats = stats_from_config(config)
    arch = stats.architecture
    lora = Adapters(lora_rank=8).trainable(arch)
    plan = estimate(config=LLAMA, lora_rank=8, base_dtype="nf4", precision="pure-bf16", engine="ddp",
                    device_memory_bytes=BIG).plan("ddp")
    unquantized = stats.outside_params + arch.layers * arch.norms_per_layer * arch.hidden
    frozen = stats.params                  # every base weight stays beside the adapters
    assert plan.params == 2 * lora + math.ceil((frozen - unquantized) * 4.127 / 8 + 2 * unquantized)
    # the largest quantized matrix (an MLP projection) is dequantized to bf16 for its matmul
    assert plan.buffers["dequantized_weight"] == 2 * arch.hidden * arch.width
    assert BASE_DTYPES["nf4"] * 8 == pytest.approx(4.127)


@pytest.mark.parametrize("loss", ["plain", "chunked", "fused"])
def test_loss_variants_keep_what_their_kernels_keep(loss):
    b, s, v, h = 2, 1024, 32000, 4096
    expected = {"plain": (12 + 2) * b * s * v, "chunked": 4 * b * s * v + math.ceil(2 * b * s * v / 8),
                "fused": (4 + 2 + 2) * b * s * h}[loss]
    assert loss_bytes(loss, v, h, b, s, 2) == expected
    if loss == "chunked":  # compiled: each chunk keeps its bf16 logits, the softmax is recomputed
        assert loss_bytes(loss, v, h, b, s, 2, compiled=True) == 2 * b * s * v + math.ceil(2 * b * s * v / 8)
    result = estimate(config=LLAMA, micro_batch=b, seq_len=s, loss=loss, device_memory_bytes=BIG)
    assert result.model.logits(b, result.setup) == expected
    forward = result.plan("ddp").moments["forward"]
    plain = estimate(config=LLAMA, micro_batch=b, seq_len=s, device_memory_bytes=BIG).plan("ddp").moments["forward"]
    assert plain - forward == pytest.approx(1.05 * (loss_bytes("plain", v, h, b, s, 2) - expected), abs=2)


def test_fused_norm_and_compile_drop_the_element_wise_copies():
    arch = stats_from_config(json.loads(LLAMA.read_text())).architecture
    h, f, c = arch.hidden, arch.width, 2
    eager = layer_bytes(arch, 4096, c, store_scores=False)
    fused = layer_bytes(arch, 4096, c, store_scores=False, kernels=Kernels(fused_norm=True))
    compiled = layer_bytes(arch, 4096, c, store_scores=False, kernels=Kernels(compiled=True))
    assert eager - fused == arch.norms_per_layer * 4 * h          # the fp32 upcast of each RMSNorm input
    assert fused - compiled == c * f                              # act(gate) recomputed from gate


def test_a_frozen_projection_keeps_no_input_unless_an_adapter_or_a_quantized_kernel_needs_it():
    arch = stats_from_config(json.loads(LLAMA.read_text())).architecture
    h, f, d, c = arch.hidden, arch.width, arch.dim, 2
    full = layer_bytes(arch, 4096, c, store_scores=False)
    qv = Adapters(lora_rank=8, lora_targets=("q_proj", "v_proj"))
    lora = layer_bytes(arch, 4096, c, store_scores=False, kernels=Kernels(adapters=qv))
    # o_proj's, the MLP's and down_proj's inputs are gone; A's rank-8 outputs are added
    assert full - lora == c * arch.heads * d + c * h + c * f - 2 * c * 8
    quantized = layer_bytes(arch, 4096, c, store_scores=False,
                            kernels=Kernels(adapters=Adapters(lora_rank=8, lora_targets=("q_proj", "v_proj"),
                                                              base_dtype="nf4")))
    assert quantized - full == 2 * c * 8                       # bitsandbytes saves every input
    dropout = Adapters(lora_rank=8, lora_targets=("q_proj", "v_proj"), lora_dropout=0.05)
    with_dropout = layer_bytes(arch, 4096, c, store_scores=False, kernels=Kernels(adapters=dropout))
    assert with_dropout - lora == 2 * (c + 1) * h                 # each adapter's dropped input and mask


def test_paged_optimizer_states_are_outside_the_allocator_and_may_page_out():
    kwargs = dict(config=LLAMA, lora_rank=64, precision="pure-bf16", engine="ddp")
    paged = estimate(optimizer="paged-adamw8bit", device_memory_bytes=BIG, **kwargs).plan("ddp")
    assert paged.outside_allocator == paged.optimizer_states > 0
    assert estimate(optimizer="adam8bit", device_memory_bytes=BIG, **kwargs).plan("ddp").outside_allocator == 0
    # On a device just too small for everything, the paged states move to the host: still "fits".
    budget = int((paged.total - paged.optimizer_states // 2) / 0.9)
    assert estimate(optimizer="paged-adamw8bit", device_memory_bytes=budget, **kwargs).plan("ddp").fits
    assert not estimate(optimizer="adam8bit", device_memory_bytes=budget, **kwargs).plan("ddp").fits


def test_muon_state_and_newton_schulz_temporaries():
    params = [torch.nn.Parameter(torch.zeros(6, 4))]
    assert optimizer_name(torch.optim.Muon(params)) == "muon"
    assert optimizer_name(torch.optim.Adafactor(params)) == "adafactor"
    plan = estimate(params=10**6, largest_layer=10**5, precision="fp32", optimizer="muon", engine="ddp",
                    device_memory_bytes=BIG).plan("ddp")
    assert plan.optimizer_states == 4 * 10**6
    # Newton-Schulz on the largest matrix (here the 1e5-element layer): 12 bytes per element
    assert plan.buffers["optimizer_step_temporaries"] == 12 * 10**5


def test_fp32_adapters_under_autocast_on_a_bf16_base_cast_only_the_adapters():
    # PEFT's fp32 adapters on a bf16 base under HF Trainer --bf16: the adapters carry fp32
    # weights, gradients and AdamW moments; autocast caches a bf16 copy of them alone (the
    # base is already bf16, so nothing casts it). A fp32 base under autocast is cast too.
    stats = stats_from_config(json.loads(LLAMA.read_text()))
    lora = Adapters(lora_rank=64).trainable(stats.architecture)
    frozen = stats.params
    kwargs = dict(config=LLAMA, lora_rank=64, precision="fp32", amp="bf16", device_memory_bytes=BIG,
                  engine="ddp", seq_len=256)
    ddp = estimate(base_dtype="bf16", **kwargs).plan("ddp")
    assert ddp.params == 2 * frozen + 4 * lora
    assert ddp.optimizer_states == 8 * lora
    assert ddp.buffers["autocast_weight_cache"] == 2 * lora
    fp32_base = estimate(**kwargs).plan("ddp")
    assert fp32_base.params == 4 * frozen + 4 * lora
    assert fp32_base.buffers["autocast_weight_cache"] == 2 * (frozen + lora)
    assert "autocast_weight_cache" not in estimate(config=LLAMA, lora_rank=64, precision="pure-bf16",
                                                   device_memory_bytes=BIG, engine="ddp").plan("ddp").buffers


def test_accumulated_gradients_live_through_the_next_forward():
    kwargs = dict(config=LLAMA, engine="ddp", precision="bf16", seq_len=4096, device_memory_bytes=BIG)
    once = estimate(**kwargs).plan("ddp")
    accumulated = estimate(grad_accum=4, **kwargs).plan("ddp")
    params = estimate(**kwargs).params
    # DDP's param.grad (freed by zero_grad after a single micro-step) is held from the first
    # micro-step's backward through the next forwards: bf16 gradients plus 5% fragmentation.
    assert accumulated.moments["forward"] - once.moments["forward"] == pytest.approx(1.05 * 2 * params, abs=2)


def test_optimizer_in_backward_holds_one_gradient_at_a_time():
    kwargs = dict(config=LLAMA, engine="fsdp2", precision="bf16", world_size=8, device_memory_bytes=BIG)
    plain = estimate(**kwargs).plan("zero3")
    in_backward = estimate(optimizer_in_backward=True, **kwargs).plan("zero3")
    stats = estimate(**kwargs).stats
    from memory_estimator.terms.model_states import plan_spec
    from memory_estimator.plan.memory import _engine_terms

    result = estimate(optimizer_in_backward=True, **kwargs)
    terms = _engine_terms(plan_spec("zero3"), stats, result.setup, result.engine_model, None)
    assert terms.grads == 2 * math.ceil(stats.largest_tensor / 8) and terms.grads_transient
    assert "optimizer_step_temporaries" not in terms.step
    assert in_backward.moments["step"] < plain.moments["step"]
    with pytest.raises(EstimatorInputError, match="accumulate"):
        estimate(optimizer_in_backward=True, grad_accum=2, **kwargs)
    with pytest.raises(EstimatorInputError, match="fp16 loss scaling"):
        estimate(config=LLAMA, precision="fp16", optimizer_in_backward=True)


def test_shardengine_step_in_backward_holds_one_bucket_slice():
    """shard(step_in_backward=True): stages 1-3 only (no offload); at stage 3 the gradients held
    are one unit's slice, not the whole shard (tests/estimator/test_estimator_in_backward.py
    checks the exact model against the engine)."""
    kwargs = dict(config=LLAMA, precision="bf16", world_size=8, device_memory_bytes=BIG)
    plain = estimate(**kwargs)
    ours = estimate(optimizer_in_backward=True, **kwargs)
    assert [p.name for p in ours.plans] == ["zero1", "zero2", "zero3"]
    from memory_estimator.terms.model_states import plan_spec
    from memory_estimator.plan.memory import _engine_terms

    def terms(result, plan):
        return _engine_terms(plan_spec(plan), result.stats, result.setup, result.engine_model, None)
    zero3 = terms(ours, "zero3")
    assert zero3.grads == 2 * math.ceil(ours.stats.largest_unit / 8) < terms(plain, "zero3").grads
    assert zero3.grads_transient and "optimizer_step_temporaries" in zero3.step  # stepped bucket by bucket
    assert terms(ours, "zero1").grads == terms(plain, "zero1").grads  # stage 1 fills its full buckets
    assert ours.plan("zero3").moments["step"] < plain.plan("zero3").moments["step"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(params=7e9, lora_rank=8), "needs the model's shapes"),
    (dict(config=LLAMA, lora_rank=8, trainable_params=10), "not both"),
    (dict(config=LLAMA, base_dtype="nf4"), "frozen base"),
    (dict(config=LLAMA, lora_rank=8, lora_targets="qkv"), "unknown LoRA target"),
    (dict(params=1000, trainable_params=2000), "exceed"),
    (dict(config=LLAMA, loss="flash"), "unknown loss"),
    (dict(config=LLAMA, lora_rank=8, base_dtype="nf3"), "unknown base dtype"),
])
def test_bad_fine_tuning_input_is_a_clear_error(kwargs, message):
    with pytest.raises(EstimatorInputError, match=message):
        estimate(**kwargs)


def test_qwen3_moe_config_as_transformers_5_writes_it_counts_like_the_meta_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 97, "num_experts": 6, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    written = AutoConfig.for_model(**small).to_dict()
    assert written.get("num_local_experts") == 6 and "num_experts" not in written or written.get("num_experts") is None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))
    written.pop("architectures", None)
    assert stats_from_config(written).params == sum(p.numel() for p in model.parameters())


def test_activation_profile_with_adapters_and_checkpointing_is_consistent():
    arch = stats_from_config(json.loads(LLAMA.read_text())).architecture
    kernels = Kernels(adapters=Adapters(lora_rank=8))
    full = activation_profile(arch, ActivationInputs(1, 2048, "full", kernels=kernels))
    none = activation_profile(arch, ActivationInputs(1, 2048, "none", kernels=kernels))
    assert full.stored + full.recompute < none.stored


def test_activation_offloading_keeps_two_layers_in_flight():
    arch = stats_from_config(json.loads(LLAMA.read_text())).architecture
    kept = activation_profile(arch, ActivationInputs(2, 4096, "full"))
    offloaded = activation_profile(arch, ActivationInputs(2, 4096, "full", offload=True))
    layer_input = 2 * 4096 * 2 * arch.hidden          # each checkpointed layer keeps its bf16 input
    assert offloaded.stored == 2 * layer_input and offloaded.recompute == kept.recompute
    plan = estimate(config=LLAMA, checkpointing="full", activation_offload=True, micro_batch=2, seq_len=4096,
                    device_memory_bytes=BIG).plan("ddp")
    assert plan.activations in (0, 2 * layer_input, 2 * layer_input + kept.recompute)


def test_the_muon_recipe_adds_adamw_state_on_the_parameters_outside_the_blocks():
    stats = stats_from_config(json.loads(LLAMA.read_text()))
    kwargs = dict(config=LLAMA, precision="bf16", world_size=4, engine="fsdp2", device_memory_bytes=BIG)
    muon = estimate(optimizer="muon", **kwargs).plan("zero3").optimizer_states
    recipe = estimate(optimizer="muon-adamw", **kwargs).plan("zero3").optimizer_states
    assert muon == 4 * math.ceil(stats.params / 4)               # one fp32 momentum per parameter
    assert recipe - muon == math.ceil(4 * stats.outside_params / 4)  # AdamW's exp_avg_sq on embeddings and head


def _benchmark_base(layers: int = 4, hidden: int = 128, vocab: int = 256):
    """The Llama shape of ``benchmarks/bench_finetune_load.py`` (smaller), built on meta with its LoRA."""
    peft = pytest.importorskip("peft")
    import transformers
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
                                      vocab_size=vocab)
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config)
    base_bytes = sum(p.numel() * 4 for p in base.parameters())
    block_bytes = sum(p.numel() * 4 for p in base.model.layers[0].parameters())
    net = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() for p in net.parameters() if p.requires_grad)
    return config.to_dict(), base_bytes, block_bytes, adapters


@pytest.mark.parametrize("world", [2, 4])
def test_load_host_peak_is_the_benchmarks_shard_plus_two_units(world):
    """At stage 3 a rank holds its shard of the streamed-in base, the adapters as peft drew them
    and two units (what bench_finetune_load.py measures and test_peft_meta.py bounds); the
    plans that shard no parameters load the whole base on every rank."""
    config, base_bytes, block_bytes, adapters = _benchmark_base()
    result = estimate(config=config, lora_rank=8, lora_targets="q_proj,v_proj", world_size=world, precision="fp32",
                      device_memory_bytes=BIG, engine="shardengine")
    # the blocks are the largest units here (the embedding is vocab x hidden = 128 KiB)
    assert result.plan("zero3").load_host_peak == math.ceil(base_bytes / world) + 2 * block_bytes + 4 * adapters
    for name in ("ddp", "zero1", "zero2"):
        assert result.plan(name).load_host_peak == base_bytes + 4 * adapters
    assert result.plan("zero3").to_json_dict()["load_host_peak_bytes"] == result.plan("zero3").load_host_peak


def test_load_host_peak_of_a_quantized_base_reads_bf16_units():
    """NF4 at stage 3: the quantized shard, and two units as the bf16 checkpoint holds them."""
    config, _, block_bytes, adapters = _benchmark_base()
    plain = estimate(config=config, lora_rank=8, lora_targets="q_proj,v_proj", world_size=2, precision="bf16",
                     device_memory_bytes=BIG, engine="shardengine", base_dtype="nf4").plan("zero3")
    stats = stats_from_config(config)
    from memory_estimator.terms.adapters import frozen_storage_bytes
    spec = Adapters(lora_rank=8, lora_targets=("q_proj", "v_proj"), base_dtype="nf4")
    stored = frozen_storage_bytes(stats, spec, stats.params, 2)
    assert plain.load_host_peak == math.ceil(stored / 2) + 4 * adapters + 2 * 2 * (block_bytes // 4)


def test_plans_without_adapters_report_no_load_peak():
    result = estimate(config=small_llama(), world_size=2, device_memory_bytes=BIG, engine="shardengine")
    assert all(plan.load_host_peak == 0 and "load_host_peak_bytes" not in plan.to_json_dict()
               for plan in result.plans)


def test_deepspeed_zero_init_linear_keeps_every_frozen_projections_input_at_stage_3():
    """zero.Init swaps F.linear for LinearFunctionForZeroStage3, which saves its input whatever
    requires grad: under LoRA on q and v, o_proj's, the MLP's and down_proj's inputs stay too."""
    config = small_llama()
    kwargs = dict(config=config, lora_rank=8, lora_targets="q_proj,v_proj", engine="deepspeed", world_size=2,
                  precision="bf16", micro_batch=3, seq_len=16, device_memory_bytes=BIG)
    result = estimate(**kwargs)
    h, f, layers, c, tokens = 64, 160, 3, 2, 3 * 16
    extra = layers * tokens * c * (h + h + f)          # o_proj's input (heads x dim = h), gate/up's, down's
    assert result.plan("zero3").activations - result.plan("zero2").activations == extra
    assert result.plan("zero3-offload-params").activations == result.plan("zero3").activations
    off = estimate(**kwargs, deepspeed_config={"bf16": {"enabled": True},
                                               "zero_optimization": {"memory_efficient_linear": False}})
    assert off.plan("zero3").activations == off.plan("zero2").activations == result.plan("zero2").activations
    fsdp = estimate(**{**kwargs, "engine": "fsdp2"})                 # torch's linear: frozen inputs dropped
    assert fsdp.plan("zero3").activations == result.plan("zero2").activations


def test_a_quantized_base_is_gathered_at_its_packed_blocks_and_a_16_bit_root():
    """bitsandbytes leaves embeddings and head 16-bit: FSDP2 gathers the root whole and each block
    at its packed 4-bit codes, not every unit at the model's average storage ratio; the
    quantization state is no parameter: whole on every rank, offloaded or not."""
    result = estimate(config=small_llama(), lora_rank=8, lora_targets="q_proj,v_proj", base_dtype="nf4",
                      precision="pure-bf16", engine="fsdp2", world_size=2, device_memory_bytes=BIG)
    root = 2 * 101 * 64 + 64                          # embeddings, head, final norm
    norms, lora = 2 * 64, 8 * (64 + 64) + 8 * (64 + 32)
    block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + norms  # q, o; k, v (2 kv heads of 16); MLP; norms
    # the adapters come beside the quantized linears (PEFT keeps every base weight)
    stored_block = math.ceil((block - norms) * 0.5 / 2) + norms + lora   # codes in 2-byte elements
    assert result.plan("zero3").buffers["all_gather_buffers"] == 2 * (root + 3 * stored_block)
    quantized = 3 * (block - norms)
    state = math.ceil(quantized * (4.127 - 4) / 8)      # absmax per 64 (uint8) and its nested fp32 absmax
    assert result.plan("zero3-offload-params").params == state
    packed = math.ceil(quantized * 0.5 + 2 * (root + 3 * norms))
    assert result.plan("zero3").params == state + math.ceil(packed / 2) + 2 * math.ceil(3 * lora / 2)
