"""Links stated by rate and kernel families by name reach the time and memory models (hand-computed values),
and every answer says how sure it is (exact / modelled / assumption, the range, what the verdict turns on)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memory_estimator import TimingRequest, estimate, time_estimate
from memory_estimator.cli import main
from memory_estimator.errors import EstimatorInputError
from memory_estimator.hardware.interconnects import resolve_link
from memory_estimator.hardware.link_rates import host_staged, rate_link
from memory_estimator.measure.field import comparable_bytes
from memory_estimator.model.stats import Architecture
from memory_estimator.terms.activations import layer_bytes
from memory_estimator.terms.kernel_families import kernel_set
from memory_estimator.terms.kernels import Kernels, loss_bytes
from memory_estimator.terms.overheads import Overheads
from memory_estimator.timing.inputs import Workload
from memory_estimator.timing.operations import micro_step_operations

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = Architecture(layers=4, hidden=512, heads=8, vocab=8000, mlp_width=1376, gated_mlp=True, norm="rmsnorm",
                     dropout=False)


# --------------------------------------------------------------------------- links


@pytest.mark.parametrize("text, role, per_node, nominal, latency", [
    ("200GB/s", "intra", None, 200e9, 1e-6),
    ("50GB/s,2us", "intra", None, 50e9, 2e-6),
    ("400Gb/s", "inter", None, 50e9, 5e-6),
    ("400Gb/s/node", "inter", 8, 6.25e9, 5e-6),
    ("3.2Tb/s per node", "inter", 8, 50e9, 5e-6),
    ("100Gbps,25us", "inter", None, 12.5e9, 25e-6),
])
def test_a_link_by_its_rate(text, role, per_node, nominal, latency):
    link = resolve_link(text, role=role, gpus_per_node=per_node)
    assert link.nominal_bytes_per_s == pytest.approx(nominal) and link.latency_s == pytest.approx(latency)
    assert link.bandwidth_bytes_per_s == pytest.approx(0.8 * nominal)    # as the catalog's nominal links


@pytest.mark.parametrize("text", ["400 furlongs", "400Gb/s/node", "0GB/s", "12"])
def test_a_rate_that_says_nothing_usable_is_refused(text):
    with pytest.raises(EstimatorInputError, match="link"):
        rate_link(text, "inter", gpus_per_node=None)


def _timed(**timing):
    result = estimate(config=str(CONFIGS / "llama-2-7b.json"), world_size=16, device="A100-80GB", micro_batch=1,
                      seq_len=2048)
    return time_estimate(result, TimingRequest(nodes=2, gpus_per_node=8, **timing))


def test_a_stated_rate_times_the_step_as_the_catalog_link_with_the_same_numbers():
    by_name, by_rate = _timed(interconnect="ib-ndr"), _timed(interconnect="400Gb/s,5us")
    assert [t.step_s for t in by_rate.times] == [t.step_s for t in by_name.times]
    slower = _timed(interconnect="400Gb/s/node")         # eight GPUs share one 400 Gb/s NIC
    inter = [c for t in slower.times for c in t.collectives if c.link == "inter"]
    assert inter and slower.cluster.inter.bandwidth_bytes_per_s == pytest.approx(0.8 * 400e9 / 8 / 8)
    assert max(t.comm_s for t in slower.times) > max(t.comm_s for t in by_name.times)


def test_p2p_off_stages_the_intra_node_link_through_host_memory():
    timed = _timed(intra_node="nvlink3", p2p=False)
    assert timed.cluster.intra.bandwidth_bytes_per_s == pytest.approx(0.8 * 300e9 / 2)
    assert timed.cluster.intra.latency_s == pytest.approx(2e-6)
    assert host_staged(resolve_link("pcie3")).nominal_bytes_per_s == pytest.approx(8e9)


def test_the_cli_takes_rates_and_p2p(capsys):
    code = main(["--config", str(CONFIGS / "llama-2-7b.json"), "--nodes", "2", "--gpus-per-node", "8",
                 "--device", "H100-80GB", "--interconnect", "400Gb/s/node", "--intra-node", "200GB/s", "--p2p",
                 "off", "--json"])
    topology = json.loads(capsys.readouterr().out)["topology"]
    assert code in (0, 1)
    assert topology["inter_node"]["nominal_bytes_per_s"] == pytest.approx(6.25e9)
    assert topology["intra_node"]["nominal_bytes_per_s"] == pytest.approx(100e9)


# --------------------------------------------------------------------------- kernel families


def test_families_name_their_kernels_and_combine():
    assert kernel_set("liger") .loss == "fused" and kernel_set("liger").mlp == "fused"
    assert kernel_set("unsloth").mlp == "fused-recompute" and kernel_set("unsloth").loss == "inplace"
    both = kernel_set("apex,flash-attn-fused")
    assert both.fused_norm and both.fused_residual and both.families == ("apex", "flash-attn-fused")
    with pytest.raises(EstimatorInputError, match="unknown kernel family"):
        kernel_set("ligr")


def test_what_each_family_keeps_per_token_hand_computed():
    h, f, c = 512, 1376, 2
    attention = c * h + c * 3 * h + c * h                     # q/k/v input, q, k, v, out-projection input
    eager = 2 * (4 + c) * h + attention + c * h + 4 * c * f   # fp32 norm copies; gate, up, act, product
    liger = 2 * c * h + attention + c * h + 3 * c * f         # fused norms; act(gate) recomputed
    unsloth = 2 * c * h + attention + c * h + 2 * c * f       # the product recomputed too
    for kernels, expected in ((Kernels(), eager), (Kernels(fused_norm=True, mlp="fused"), liger),
                              (Kernels(fused_norm=True, mlp="fused-recompute"), unsloth)):
        assert layer_bytes(SMALL, 1024, c, store_scores=False, kernels=kernels) == expected
    tokens = 2 * 1024
    assert loss_bytes("inplace", 8000, h, 2, 1024, c) == c * tokens * 8000 + 4 * tokens
    assert loss_bytes("fused", 8000, h, 2, 1024, c) == (4 + c) * tokens * h + c * tokens * h


GEMMA_LIKE = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 256,
              "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 1024, "tie_word_embeddings": True}


QUIET = Overheads(cuda_context_bytes=0, fragmentation_fraction=0.0, nccl_bytes=0)


def _gemma_like(tmp_path, stated, **override):
    config = dict(GEMMA_LIKE, **({"torch_dtype": stated} if stated else {}), **override)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "config.json")


@pytest.mark.parametrize("stated, kernels, point, high", [
    ("float32", "unsloth", 2, 2 + 4),  # transformers >= 4.50: no copy; < 4.50: the fp16 logits beside their fp32 copy
    ("bfloat16", "unsloth", 2, 2),     # a 16-bit checkpoint: the cast changes no size, no range
    (None, "unsloth", 2, 2),           # unstated: no cast is assumed
    ("float32", None, 2, 2),           # the cast is Unsloth's forward, not the in-place loss's
])
def test_unsloths_logits_cast_is_the_ranges_high_end_hand_computed(tmp_path, stated, kernels, point, high):
    answer = estimate(config=_gemma_like(tmp_path, stated), device="T4", precision="fp16", micro_batch=2,
                      seq_len=256, kernels=kernels, loss="plain" if kernels else "inplace", lora_rank=8,
                      overheads=QUIET)
    tokens, plan = 2 * 256, answer.plans[0]
    term = next(term for term in plan.confidence.terms if term.term == "logits_and_loss")
    assert plan.buffers["logits_and_loss"] == term.bytes == term.low == point * tokens * 32000 + 4 * tokens
    assert term.high == high * tokens * 32000 + 4 * tokens      # no fragmentation charged (QUIET)
    assert plan.confidence.high - plan.confidence.low == term.high - term.low   # the answer's only range
    assert (term.basis, "transformers < 4.50" in term.why) == (("assumption", True) if high != point
                                                               else ("modelled", False))
    assert plan.to_json_dict()["confidence"]["terms"][[t.term for t in plan.confidence.terms].index(
        "logits_and_loss")]["high"] == term.high
    assert loss_bytes("inplace", 32000, 256, 2, 256, 2, cast=4) == 6 * tokens * 32000 + 4 * tokens


def test_the_verdict_on_an_unstated_logits_cast_is_judged_on_its_top(tmp_path):
    # a 256k vocabulary at 2 x 10240 tokens: 10 GiB of fp16 logits fit a T4, with the fp32 copy 30 GiB do not
    answer = estimate(config=_gemma_like(tmp_path, "float32", vocab_size=256000, max_position_embeddings=16384),
                      device="T4", precision="fp16", micro_batch=2, seq_len=10240, kernels="unsloth", lora_rank=8)
    plan = answer.plans[0]
    assert plan.verdict == "tight" and not plan.fits
    assert any("transformers version" in line for line in plan.confidence.turns_on)


def test_an_unstated_logits_cast_adds_at_the_top_what_a_priced_one_does_and_nothing_at_the_point(tmp_path):
    """Over varying lengths the cached segments stay the point's replay; the logits term's high end
    carries the whole rise (the copy and the longer batches' segments replayed with it), once."""
    from dataclasses import replace

    from memory_estimator.allocator.reserved import shape_cache
    from memory_estimator.plan.inputs import MemoryInputs
    from memory_estimator.plan.memory import plan_estimate

    answer = estimate(config=_gemma_like(tmp_path, "float32"), device="T4", precision="fp16", micro_batch=2,
                      seq_len=512, mean_seq_len=128, steps=40, kernels="unsloth", lora_rank=8)
    setup = answer.setup
    assert setup.logits_cast is None
    inputs = MemoryInputs(answer.stats, setup, answer.device, answer.model, answer.overheads, answer.engine_model,
                          answer.exact_engine, answer.capacity, shape_cache=answer.shape_cache)
    priced = replace(setup, logits_cast=True)
    cast_cache = shape_cache(answer.model.step_shape(2, priced), setup.lengths)
    plan = inputs.engine.plans[0]
    unstated = plan_estimate(plan, replace(inputs, cast_shape_cache=cast_cache))
    without = plan_estimate(plan, replace(inputs, setup=replace(setup, logits_cast=False)))
    with_cast = plan_estimate(plan, replace(inputs, setup=priced, shape_cache=cast_cache))
    assert unstated.buffers == without.buffers and unstated.confidence.low == without.confidence.low
    assert unstated.confidence.high == with_cast.confidence.high > without.confidence.high
    assert with_cast.buffers["cached_segments_other_lengths"] > without.buffers["cached_segments_other_lengths"]
    assert set(with_cast.confidence.turns_on) <= set(unstated.confidence.turns_on)
    assert answer.plans[0].confidence.high == unstated.confidence.high     # what estimate() answers


def test_families_reach_the_estimate():
    common = dict(config=str(CONFIGS / "llama-2-7b.json"), device="H100-80GB", micro_batch=2, seq_len=2048)
    eager, liger, unsloth = (estimate(**common, kernels=k) for k in (None, "liger", "unsloth"))
    assert (liger.setup.loss, liger.setup.fused_norm, liger.setup.mlp_kernel) == ("fused", True, "fused")
    assert unsloth.setup.loss == "inplace" and unsloth.setup.kernel_families == ("unsloth",)
    assert eager.plans[0].activations > liger.plans[0].activations > unsloth.plans[0].activations
    assert estimate(**common, kernels="liger", loss="chunked").setup.loss == "chunked"   # an explicit loss wins


def test_families_reach_the_time_model_hand_computed():
    base = dict(params=10**8, tokens_per_micro_step=1000, layers=4, hidden=512, seq_len=1000, mlp_width=1376,
                gated_mlp=True, norm="rmsnorm", kv_width=512, vocab=8000)

    def elementwise(**kernels):
        return next(op.bytes for op in micro_step_operations(Workload(**base, **kernels))
                    if op.name == "element-wise" and op.phase == "forward")

    h, f, layout = 512, 1376, 4 * (2 * 512 + 2 * 512)
    assert elementwise() == 1000 * 4 * (2 * 40 * h + 12 * h + 10 * f + layout)
    assert elementwise(fused_norm=True, fused_mlp=True) == 1000 * 4 * (2 * 4 * h + 12 * h + 6 * f + layout)
    assert elementwise(fused_norm=True, fused_mlp=True, fused_residual=True) == \
        1000 * 4 * (2 * 4 * h + 8 * h + 6 * f + layout)
    loss = {op.name: op.bytes for op in micro_step_operations(Workload(**base, loss="inplace")) if op.phase == "forward"}
    assert loss["loss"] == pytest.approx(1000 * 6 * 8000 / 3)     # 6 bytes per logit over forward and backward
    cast = {op.name: op.bytes for op in micro_step_operations(Workload(**base, loss="inplace", logits_cast=4))
            if op.phase == "forward"}
    # fp32 copies: the loss reads 4, reads 4 and writes 4; the cast reads 2, writes 4 and back
    assert cast["loss"] == pytest.approx(1000 * (3 * 4 + 2 * (2 + 4)) * 8000 / 3)


# --------------------------------------------------------------------------- how sure


GPT2_XL = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25,
           "n_positions": 1024, "n_ctx": 1024, "vocab_size": 50257}
XL_RUN = dict(config=GPT2_XL, engine="deepspeed", world_size=4, device="A100-40GB", precision="fp16", micro_batch=40,
              seq_len=1024, checkpointing="full", fused_attention=False, optimizer="adam",
              deepspeed_config={"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}})


def test_an_unstated_loss_precision_is_a_range_not_a_does_not_fit():
    unstated = estimate(**XL_RUN).plan("zero3")
    logits = next(t for t in unstated.confidence.terms if t.term == "logits_and_loss")
    assert logits.basis == "assumption" and logits.low == 3 * 2 * 40 * 1024 * 50257 and logits.high == logits.bytes
    assert unstated.verdict == "tight" and any("--no-loss-upcast" in t for t in unstated.confidence.turns_on)
    stated = estimate(**XL_RUN, loss_upcast=False).plan("zero3")
    assert stated.verdict == "fits"
    assert stated.confidence.low == stated.confidence.high == stated.total
    # the published run (ColossalAI's GPT-2 XL benchmark) measured 25,361 MB allocated
    assert comparable_bytes(estimate(**XL_RUN, loss_upcast=False), "zero3", "allocated") == \
        pytest.approx(25360.968e6, rel=0.1)


def test_shardengines_own_layout_is_exact_and_the_rest_is_said_to_be_modelled():
    def build():
        return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))

    exact = estimate(module=build, world_size=2, device="A100-80GB", hidden=256, layers=2, heads=4, vocab=256)
    bases = {t.term: t.basis for t in exact.plan("zero3").confidence.terms}
    assert bases["params"] == bases["optimizer_states"] == "exact"
    modelled = estimate(params=7e9, world_size=8, device="A100-80GB", engine="fsdp2")
    payload = modelled.to_json_dict()["plans"][0]["confidence"]
    assert {t["term"]: t["basis"] for t in payload["terms"]}["params"] == "modelled"
    assert payload["unbounded"] == ["the activations (not estimated: give the model's shapes) exceed the headroom"]
    assert set(payload) >= {"terms", "reserved_range_bytes", "nvidia_smi_range_bytes", "holds_over", "turns_on"}


def test_deepspeeds_step_segments_are_reserved_not_allocated():
    run = dict(config=str(CONFIGS / "llama-2-7b.json"), engine="deepspeed", world_size=8, device="A100-80GB",
               micro_batch=1, seq_len=2048)
    plain = estimate(**run)
    zero2 = plain.plan("zero2")
    assert zero2.peak_moment == "forward"
    shard = -(-plain.params // 8)
    assert zero2.buffers["cached_step_segments"] == (2 + 4) * shard     # the flat 16-bit and fp32 partitions
    fixed = plain.plan("zero2").total - zero2.buffers["cached_step_segments"]
    assert comparable_bytes(plain, "zero2", "allocated") == comparable_bytes(plain, "zero2", "reserved") - \
        zero2.buffers["cached_step_segments"] - zero2.buffers["allocator_fragmentation"]
    expandable = estimate(**run, expandable_segments=True).plan("zero2")
    assert "cached_step_segments" not in expandable.buffers and expandable.total == fixed
