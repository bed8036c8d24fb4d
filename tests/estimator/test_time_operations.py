"""The per-operation step-time model (timing/operations.py): each operation's FLOPs, bytes and
seconds against values computed by hand from its mechanism and the published constants."""
from __future__ import annotations

import pytest

from memory_estimator.hardware.achievable import achievable
from memory_estimator.hardware.rates import device_rates
from memory_estimator.terms.adapters import Adapters
from memory_estimator.model.stats import Architecture
from memory_estimator.timing.adapter_shapes import adapted_widths
from memory_estimator.timing.operations import micro_step_operations, operation_seconds
from memory_estimator.timing.optimizer_bytes import step_bytes_per_element
from memory_estimator.timing.step import Cluster, Workload, compute_seconds, resolve_link

A100 = device_rates("A100-80GB")
H100 = device_rates("H100-80GB")
# a small Llama-shaped model: 2 layers, h 64, gated MLP f 128, GQA kv width 32, vocab 1000
SHAPE = dict(params=200_000, tokens_per_micro_step=4096, layers=2, hidden=64, seq_len=1024, mlp_width=128,
             gated_mlp=True, kv_width=32, vocab=1000, norm="rmsnorm", outside_params=64_000)


def ops(**overrides) -> dict[tuple[str, str], object]:
    return {(op.name, op.phase): op for op in micro_step_operations(Workload(**{**SHAPE, **overrides}))}


def test_dense_matmuls_count_input_and_weight_gradients_and_a_frozen_base_only_the_input_ones():
    t = 4096
    full = ops()
    assert full["matmuls", "forward"].flops == 2 * 200_000 * t
    assert full["matmuls", "backward"].flops == 4 * 200_000 * t
    frozen = ops(trainable=1000)  # trainable_params without LoRA: the trained part lies inside the base
    assert frozen["matmuls", "backward"].flops == 2 * 200_000 * t + 2 * 1000 * t
    lora = ops(trainable=10_000, lora_rank=8, adapter_inputs=500, adapter_outputs=750)
    assert lora["matmuls", "forward"].flops == 2 * 190_000 * t      # the adapters are priced apart
    assert lora["matmuls", "backward"].flops == 2 * 190_000 * t     # the frozen base: input gradients only


def test_a_matmul_is_priced_by_its_roofline():
    rates = achievable("A100-80GB", "ampere")
    matmuls = ops()["matmuls", "forward"]
    # bytes: weights once, each layer's input h and output Ψ/h per token, 2 bytes each
    assert matmuls.bytes == 2 * (200_000 + 2 * 4096 * 64 + 4096 * 200_000 / 64)
    compute_bound = matmuls.flops / (312e12 * 0.869 * rates.sustained)
    memory_bound = matmuls.bytes / (2.039e12 * 0.88 * rates.sustained)
    assert operation_seconds(matmuls, A100, "bf16", rates) == pytest.approx(max(compute_bound, memory_bound))


def test_lora_a_and_b_are_memory_bound_reads_and_writes_of_the_activations():
    rates = achievable("A100-80GB", "ampere")
    t, r = 4096, 8
    lora = ops(trainable=10_000, lora_rank=r, adapter_inputs=500, adapter_outputs=750)
    a, b = lora["LoRA A", "forward"], lora["LoRA B", "forward"]
    assert (a.flops, a.bytes) == (2 * t * r * 500, 2 * t * (500 + r))
    assert (b.flops, b.bytes) == (2 * t * r * 750, 2 * t * (750 + r))
    assert lora["LoRA A", "backward"].flops == 2 * a.flops and lora["LoRA B", "backward"].bytes == 2 * b.bytes
    assert operation_seconds(a, A100, "bf16", rates) == pytest.approx(a.bytes / (2.039e12 * 0.88 * rates.sustained))
    assert lora["LoRA add and dropout", "forward"].bytes == t * 10 * 750               # eager scale and add
    assert ops(trainable=10_000, lora_rank=r, adapter_inputs=500, adapter_outputs=750, compile=True,
               lora_dropout=0.1)["LoRA add and dropout", "forward"].bytes == t * (6 * 750 + 5 * 500)
    assert lora["LoRA input-gradient add", "backward"].bytes == 6 * 500 * t


def test_adapted_widths_sum_the_targets_inputs_and_outputs():
    arch = Architecture(layers=2, hidden=64, heads=4, vocab=1000, kv_heads=2, mlp_width=128, gated_mlp=True)
    widths = adapted_widths(arch, Adapters(lora_rank=8, lora_targets=("q_proj", "v_proj", "down_proj")))
    # q: 64 -> 64, v: 64 -> 2 heads x 16 = 32, down: 128 -> 64; two layers
    assert widths == {"adapter_inputs": 2 * (64 + 64 + 128), "adapter_outputs": 2 * (64 + 32 + 64)}


def test_attention_runs_the_causal_flash_count_at_the_kernels_published_rates():
    attention = ops()
    forward = 2 * 2 * 64 * 1024 * 4096                 # 2·L·h·s per token
    assert attention["attention", "forward"].flops == forward
    assert attention["attention", "backward"].flops == 2.5 * forward
    ampere, hopper = achievable("A100-80GB", "ampere"), achievable("H100-80GB", "hopper")
    assert operation_seconds(attention["attention", "forward"], A100, "bf16", ampere) == \
        pytest.approx(forward / (312e12 * 0.73 * ampere.sustained))
    assert operation_seconds(attention["attention", "backward"], A100, "bf16", ampere) == \
        pytest.approx(2.5 * forward / (312e12 * 0.50 * ampere.sustained))
    assert operation_seconds(attention["attention", "forward"], H100, "bf16", hopper) == \
        pytest.approx(forward / (989e12 * 0.35 * hopper.sustained))


def test_element_wise_bytes_per_token_eager_fused_and_compiled():
    h, f, kv, layers, t = 64, 128, 32, 2, 4096
    layout = 4 * (2 * h + 2 * kv)
    eager = 2 * 40 * h + 12 * h + 10 * f + layout      # torch-op RMSNorms, residual adds, act(gate)*up
    assert ops()["element-wise", "forward"].bytes == eager * layers * t
    assert ops()["element-wise", "backward"].bytes == 2 * eager * layers * t
    assert ops(fused_norm=True)["element-wise", "forward"].bytes == (eager - 2 * 36 * h) * layers * t
    compiled = 2 * 4 * h + 8 * h + 6 * f + layout
    assert ops(compile=True)["element-wise", "forward"].bytes == compiled * layers * t
    layernorm_gelu = 2 * 4 * h + 12 * h + 4 * f + layout + 10 * h
    assert ops(norm="layernorm", gated_mlp=False, dropout=True)["element-wise", "forward"].bytes == \
        layernorm_gelu * layers * t


def test_the_loss_moves_its_logits_by_kernel():
    t, vocab = 4096, 1000
    eager = ops()
    assert eager["loss", "forward"].bytes + eager["loss", "backward"].bytes == pytest.approx(36 * vocab * t)
    compiled = ops(compile=True, loss="chunked")
    assert compiled["loss", "forward"].bytes + compiled["loss", "backward"].bytes == pytest.approx(6 * vocab * t)
    assert ("loss", "forward") not in ops(loss="fused")


def test_dequantization_reads_the_stored_weight_and_writes_a_16_bit_copy_per_pass():
    numel = 100_000
    nf4 = ops(quantized_numel=numel, quantized_bytes=0.5, checkpointing="full")
    per_pass = numel * (0.5 + 2)
    assert nf4["dequantize", "forward"].bytes == nf4["dequantize", "backward"].bytes == per_pass
    assert nf4["recompute dequantize", "backward"].bytes == per_pass


def test_recomputation_runs_the_policys_forward_operations_again():
    assert not [name for name, _ in ops() if name.startswith("recompute")]
    full = ops(checkpointing="full")
    layers_share = (200_000 - 64_000) / 200_000           # embeddings and head are outside the layers
    assert full["recompute matmuls", "backward"].flops == pytest.approx(layers_share * full["matmuls", "forward"].flops)
    assert full["recompute attention", "backward"].flops == full["attention", "forward"].flops
    assert full["recompute element-wise", "backward"].bytes == full["element-wise", "forward"].bytes
    assert ("recompute loss", "backward") not in full
    selective = ops(checkpointing="selective")
    assert [name for name, _ in selective if name.startswith("recompute")] == ["recompute attention"]
    mm = ops(checkpointing="selective:mm")
    assert sorted(name for name, _ in mm if name.startswith("recompute")) == ["recompute element-wise"]


def test_the_step_is_the_sum_of_its_operations_and_a_given_efficiency_prices_flops_flat():
    work = Workload(**{**SHAPE, "grad_accum": 3})
    link = resolve_link("nvlink3")
    default = Cluster(1, 1, link, link, A100)
    rates = achievable("A100-80GB", "ampere")
    by_phase = {"forward": 0.0, "backward": 0.0}
    for op in micro_step_operations(work):
        by_phase[op.phase] += operation_seconds(op, A100, "bf16", rates)
    assert compute_seconds(work, default) == pytest.approx((3 * by_phase["forward"], 3 * by_phase["backward"]))
    flat = compute_seconds(Workload(params=10**9, tokens_per_micro_step=1000),
                           Cluster(1, 1, link, link, A100, efficiency=0.5))
    assert flat == pytest.approx((2e12 / 156e12, 4e12 / 156e12))


@pytest.mark.parametrize("precision, optimizer, expected", [
    ("fp32", "adamw", 28),              # fp32 param, grad, two moments: read 4, write 3
    ("bf16", "adamw", 28 + 8),          # + the fp32 master gradient written and read
    ("pure-bf16", "adamw", 14),         # every tensor 16-bit
    ("pure-bf16", "paged-adamw", 22),   # bitsandbytes' 32-bit state: only param and grad are 16-bit
])
def test_the_optimizer_step_moves_its_tensors_bytes(precision, optimizer, expected):
    work = Workload(params=1000, tokens_per_micro_step=1, precision=precision, optimizer=optimizer)
    assert step_bytes_per_element(work) == expected
