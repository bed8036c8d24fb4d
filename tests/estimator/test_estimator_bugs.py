"""Estimator answers that were wrong for whole classes of runs, each through the CLI as a user
would reproduce it: gradient buffers under LoRA, paged optimizer states, refused and accepted
flag combinations, the time of AMP, compile and quantized bases, catalog consistency."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memory_estimator.cli.command import build_parser, main
from memory_estimator.hardware.devices import CATALOG as DEVICES
from memory_estimator.hardware.achievable import BANDWIDTH_FRACTION, SUSTAINED_FRACTION, achievable
from memory_estimator.hardware.rates import CATALOG as RATES
from memory_estimator.hardware.interconnects import CATALOG as LINKS, _DEFAULT_INTRA, _WORKSTATION_GPUS_PER_NODE, \
    default_intra_node

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "configs"
LLAMA_7B = str(CONFIGS / "llama-2-7b.json")
LLAMA_70B = str(CONFIGS / "llama-2-70b.json")
GiB = 2**30


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out.strip() else {"stderr": captured.err})


def plan(payload: dict, name: str) -> dict:
    return next(p for p in payload["plans"] if p["name"] == name)


def lora_per_layer(rank: int, h: int, kv: int, f: int) -> int:
    """LoRA A and B of q, k, v, o, gate, up, down in one Llama layer."""
    return rank * ((h + h) * 2 + (h + kv) * 2 + (h + f) * 3)


# ----------------------------------------------------------------- memory terms


def test_fsdp2_reduce_scatter_buffers_hold_only_trainable_gradients(capsys):
    base = ["--config", LLAMA_70B, "--world-size", "8", "--engine", "fsdp2", "--precision", "pure-bf16",
            "--checkpointing", "full"]
    _, given = run(capsys, *base, "--trainable-params", "1000")
    # 1000 trained parameters: the buffers are bytes, not the 4.78 GiB of a whole frozen block
    assert plan(given, "zero3")["buffers"]["reduce_scatter_buffers"] < 2**20
    _, lora = run(capsys, *base, "--lora-rank", "16")
    block = lora_per_layer(16, 8192, 1024, 28672)
    # unsharded bf16 gradients plus the reduce-scatter input in bf16 (FSDP2's foreach_reduce)
    assert plan(lora, "zero3")["buffers"]["reduce_scatter_buffers"] == (2 + 2 * 2) * block


def test_paged_adamw_32bit_state_is_fp32_whatever_the_weights(capsys):
    for precision in ("pure-bf16", "bf16"):
        _, payload = run(capsys, "--params", "1e9", "--engine", "ddp", "--precision", precision,
                         "--optimizer", "paged-adamw", "--gpu-memory", "80GiB")
        # bitsandbytes' Optimizer2State: optim_bits == 32 -> two torch.float32 states
        assert plan(payload, "ddp")["per_rank_bytes"]["optimizer_states"] >= 8 * 10**9


def _fragmentation_base(entry: dict) -> int:
    """What the allocator holds at the peak: the total less the fixed costs, the allowance and
    the paged states it never sees."""
    buffers = entry["buffers"]
    fixed = buffers.get("cuda_context", 0) + buffers.get("nccl_buffers", 0)
    return entry["per_rank_bytes"]["total"] - fixed - buffers["allocator_fragmentation"] \
        - entry["outside_allocator_bytes"]


def test_fragmentation_is_not_charged_on_paged_states(capsys):
    _, payload = run(capsys, "--config", LLAMA_7B, "--lora-rank", "64", "--precision", "pure-bf16",
                     "--engine", "ddp", "--optimizer", "paged-adamw8bit", "--device", "A100-80GB")
    entry = plan(payload, "ddp")
    assert entry["outside_allocator_bytes"] > 0
    assert entry["buffers"]["allocator_fragmentation"] == math.ceil(0.05 * _fragmentation_base(entry))


def test_small_adapter_states_are_not_paged(capsys):
    """bitsandbytes pages a state only for tensors of >= 1e5 elements: rank-16 A/B matrices of a
    4096-wide projection (65,536 elements) are ordinary device tensors."""
    common = ["--config", LLAMA_7B, "--precision", "pure-bf16", "--engine", "ddp", "--optimizer", "paged-adamw"]
    _, r16 = run(capsys, *common, "--lora-rank", "16", "--lora-targets", "q_proj,v_proj")
    assert plan(r16, "ddp")["outside_allocator_bytes"] == 0
    _, r64 = run(capsys, *common, "--lora-rank", "64")
    entry = plan(r64, "ddp")
    assert entry["outside_allocator_bytes"] == entry["per_rank_bytes"]["optimizer_states"] > 0
    _, mixed = run(capsys, *common, "--lora-rank", "16")       # gate/up/down's 11008-wide sides are paged
    h, f = 4096, 11008
    paged = 16 * (3 * f) * 32                                    # B of gate, up; A of down (>= 1e5 each)
    total = lora_per_layer(16, h, h, f) * 32
    entry = plan(mixed, "ddp")
    assert entry["outside_allocator_bytes"] == math.floor(entry["per_rank_bytes"]["optimizer_states"] * paged / total)


# ----------------------------------------------------------------- flags refused or accepted


def test_optimizer_in_backward_is_refused_for_deepspeed(capsys):
    code = main(["--config", LLAMA_7B, "--engine", "deepspeed", "--optimizer-in-backward", "--json"])
    assert code == 2
    assert "--optimizer-in-backward is modelled for --engine ddp or fsdp2" in capsys.readouterr().err


def test_grad_accum_on_a_custom_memory_device_answers_memory(capsys):
    args = ["--config", LLAMA_7B, "--gpu-memory", "24GiB", "--lora-rank", "8", "--engine", "ddp",
            "--precision", "pure-bf16"]
    code, payload = run(capsys, *args, "--grad-accum", "4")
    assert code in (0, 1) and "topology" not in payload
    assert any("no time per step" in note for note in payload["notes"])
    _, single = run(capsys, *args)
    # the accumulated gradients live through the next forward: more memory than one micro-step
    assert plan(payload, "ddp")["per_rank_bytes"]["total"] > plan(single, "ddp")["per_rank_bytes"]["total"]
    # asking for time on it still says what to give
    assert main([*args, "--grad-accum", "4", "--nodes", "1"]) == 2
    assert "--peak-tflops" in capsys.readouterr().err


def test_output_proj_is_the_attention_output_projection(capsys):
    common = ["--config", LLAMA_7B, "--lora-rank", "8", "--engine", "ddp"]
    _, torchtune = run(capsys, *common, "--lora-targets", "q_proj,v_proj,output_proj")
    _, peft = run(capsys, *common, "--lora-targets", "q_proj,v_proj,o_proj")
    assert plan(torchtune, "ddp")["per_rank_bytes"] == plan(peft, "ddp")["per_rank_bytes"]


def test_torchao_nf4_keeps_only_the_weight(capsys):
    common = ["--config", LLAMA_7B, "--lora-rank", "16", "--lora-targets", "q_proj,v_proj", "--engine", "ddp",
              "--precision", "pure-bf16", "--micro-batch", "2", "--seq-len", "1024"]
    _, bnb = run(capsys, *common, "--base-dtype", "nf4")
    _, torchao = run(capsys, *common, "--base-dtype", "nf4", "--quantizer", "torchao")
    _, bf16 = run(capsys, *common)
    activations = lambda payload: plan(payload, "ddp")["per_rank_bytes"]["activations"]  # noqa: E731
    # LinearNF4 saves ctx.nf4_weight only: the frozen projections keep what a torch linear keeps
    assert activations(torchao) == activations(bf16) < activations(bnb)
    assert main([*common, "--base-dtype", "nf4", "--quantizer", "gptq"]) == 2
    capsys.readouterr()


# ----------------------------------------------------------------- time model


AMP_RUN = ["--params", "1.25e8", "--hidden", "768", "--layers", "12", "--heads", "12", "--vocab", "50264",
           "--engine", "ddp", "--world-size", "8", "--nodes", "1", "--gpus-per-node", "8", "--micro-batch", "32",
           "--seq-len", "2048"]


def test_autocast_runs_at_the_16bit_rate(capsys):
    _, amp = run(capsys, *AMP_RUN, "--amp", "bf16")
    _, bf16 = run(capsys, *AMP_RUN, "--precision", "bf16")
    _, fp32 = run(capsys, *AMP_RUN, "--precision", "fp32")
    compute = lambda payload: plan(payload, "ddp")["time"]["compute_s"]  # noqa: E731
    assert compute(amp) == pytest.approx(compute(bf16))
    assert compute(fp32) > 10 * compute(amp)
    assert amp["topology"]["peak_flops"] == 312e12
    # AMP's gradients are fp32: the all-reduce sends twice bf16's bytes
    assert plan(amp, "ddp")["time"]["bytes_per_step"]["intra_node"] == \
        pytest.approx(2 * plan(bf16, "ddp")["time"]["bytes_per_step"]["intra_node"], rel=1e-3)


A100_STREAM = 2.039e12 * BANDWIDTH_FRACTION * SUSTAINED_FRACTION["ampere"]  # bytes/s of memory-bound kernels
TIMED_7B = ["--config", LLAMA_7B, "--device", "A100-80GB", "--engine", "ddp", "--precision", "pure-bf16",
            "--checkpointing", "full", "--micro-batch", "4", "--seq-len", "1024", "--nodes", "1"]


def test_compile_takes_off_the_fused_element_wise_traffic(capsys):
    _, eager = run(capsys, *TIMED_7B)
    _, compiled = run(capsys, *TIMED_7B, "--compile")
    _, fused_norm = run(capsys, *TIMED_7B, "--fused-norm")
    _, both = run(capsys, *TIMED_7B, "--compile", "--fused-norm")
    compute = lambda payload: plan(payload, "ddp")["time"]["compute_s"]  # noqa: E731
    h, f, layers, tokens, vocab = 4096, 11008, 32, 4 * 1024, 32000
    per_token = 2 * 36 * h + 2 * 2 * h + 4 * f        # two eager norms, two residual re-reads, act(gate)*up
    passes = 1 + 2 + 1                                 # forward, backward (twice), full recompute
    loss = (36 - 6) * vocab * tokens                   # eager cross-entropy against compiled, once per step
    saved = (per_token * layers * tokens * passes + loss) / A100_STREAM
    assert compute(eager) - compute(compiled) == pytest.approx(saved, rel=1e-6)
    # fused norm kernels take off the norms' share alone; under compile the norms are fused already
    assert compute(compiled) < compute(fused_norm) < compute(eager) and compute(both) == compute(compiled)


def test_a_quantized_base_pays_its_dequantization(capsys):
    lora = [*TIMED_7B, "--lora-rank", "16"]
    _, bf16 = run(capsys, *lora)
    _, nf4 = run(capsys, *lora, "--base-dtype", "nf4")
    compute = lambda payload: plan(payload, "ddp")["time"]["compute_s"]  # noqa: E731
    # the blocks' linears (embeddings, head and norms stay 16-bit), dequantized in the forward,
    # the backward and the recomputed forward: read NF4, write bf16
    quantized = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    expected = 3 * quantized * (4.127 / 8 + 2) / A100_STREAM
    assert compute(nf4) - compute(bf16) == pytest.approx(expected, rel=1e-3)
    assert plan(nf4, "ddp")["time"]["tokens_per_s"] < plan(bf16, "ddp")["time"]["tokens_per_s"]


def test_help_and_docs_state_the_per_operation_default(capsys):
    help_text = " ".join(build_parser().format_help().split())
    assert "default 0.5;" not in help_text and "achievable.py" in help_text
    docs = " ".join((ROOT / "docs" / "time-model.md").read_text().split())
    assert "(default 0.5;" not in docs and "achievable.py" in docs
    _, payload = run(capsys, *TIMED_7B)
    rates = achievable("A100-80GB", "ampere")
    assert payload["topology"]["compute_efficiency"] == pytest.approx(rates.matmul * rates.sustained)


def test_peak_tflops_keeps_the_generation_and_tf32_is_expressible(capsys):
    bert = ["--params", "3.4e8", "--hidden", "1024", "--layers", "24", "--heads", "16", "--vocab", "30522",
            "--device", "A100-40GB", "--precision", "fp32", "--micro-batch", "8", "--seq-len", "512", "--nodes", "1"]
    _, plain = run(capsys, *bert)
    _, given = run(capsys, *bert, "--peak-tflops", "156")
    _, tf32 = run(capsys, *bert, "--tf32")
    assert given["topology"]["compute_efficiency"] == plain["topology"]["compute_efficiency"]
    assert given["topology"]["peak_flops"] == tf32["topology"]["peak_flops"] == 156e12
    assert plain["topology"]["peak_flops"] == 19.5e12
    _, turing = run(capsys, *bert[:-6], "--device", "T4", "--precision", "fp32", "--micro-batch", "8",
                    "--seq-len", "512", "--nodes", "1", "--tf32")
    assert turing["topology"]["peak_flops"] == RATES["T4"].peak_flops_fp32     # no TF32 before Ampere


# ----------------------------------------------------------------- catalogs agree


def test_titan_rtx_offload_plans_are_timed(capsys):
    code, payload = run(capsys, "--params", "1.3e9", "--hidden", "2048", "--layers", "24", "--heads", "16",
                        "--vocab", "50257", "--device", "TITAN-RTX", "--engine", "deepspeed", "--world-size", "2",
                        "--precision", "fp16", "--nodes", "1")
    assert code in (0, 1), payload
    assert all(p["time"]["step_time_s"] > 0 for p in payload["plans"])


def test_every_catalog_device_has_rates_links_and_a_generation():
    assert set(RATES) == set(DEVICES)
    for name, device in DEVICES.items():
        rates = RATES[name]
        assert rates.host_link in LINKS, (name, rates.host_link)
        assert default_intra_node(name) in LINKS, name
        assert rates.generation == device.generation != "unknown", name
        assert rates.peak_flops_16bit >= rates.peak_flops_fp32 > 0 and rates.memory_bytes_per_s > 0, name
    assert set(_DEFAULT_INTRA) <= set(DEVICES) and set(_DEFAULT_INTRA.values()) <= set(LINKS)
    assert set(_WORKSTATION_GPUS_PER_NODE) <= set(DEVICES)
