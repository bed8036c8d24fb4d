"""How a config.json is read: omitted fields as transformers fills them, the parts no activation model
covers named (never a silent 0), encoder-decoders with both stacks, and nonsense refused by field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memory_estimator import EstimatorInputError, estimate
from memory_estimator.model import hf_meta
from memory_estimator.model.hf_config import stats_from_config
from memory_estimator.terms.activations import ActivationInputs, activation_profile

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100, intermediate_size=96)


def _without_transformers(monkeypatch):
    monkeypatch.setattr(hf_meta, "transformers_available", lambda: False)


def test_family_defaults_are_transformers_defaults_without_it(monkeypatch):
    """Drop each field of every fixture in turn: the families' own defaults give what transformers'
    config classes fill in (Mistral's 8 kv heads, Qwen3's head_dim 128, DeepSeek-V3's 3 dense layers)."""
    pytest.importorskip("transformers")
    differ = []
    for path in sorted(CONFIGS.glob("*.json")):
        config = json.loads(path.read_text())
        for key in [k for k in config if k != "model_type"]:
            dropped = {k: v for k, v in config.items() if k != key}
            try:
                with_hf = stats_from_config(dropped)
            except EstimatorInputError as error:
                with_hf = str(error)
            with monkeypatch.context() as patch:
                _without_transformers(patch)
                try:
                    alone = stats_from_config(dropped)
                except EstimatorInputError as error:
                    alone = str(error)
            same = (alone == with_hf if isinstance(alone, str) or isinstance(with_hf, str)
                    else (alone.params, alone.architecture) == (with_hf.params, with_hf.architecture))
            if not same:
                differ.append(f"{path.stem} without {key}")
    assert differ == []


@pytest.mark.parametrize("config, params", [
    # transformers 5.x meta builds of the same configs (parameters counted on the meta device)
    (dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
          num_hidden_layers=32, vocab_size=32000), 7_241_732_096),
    (dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
          num_hidden_layers=36, vocab_size=151936, tie_word_embeddings=True), 4_022_468_096),
], ids=["mistral-8-kv-heads", "qwen3-head-dim-128"])
def test_omitted_fields_take_the_config_class_defaults(config, params, monkeypatch):
    assert stats_from_config(config).params == params
    _without_transformers(monkeypatch)
    assert stats_from_config(config).params == params


def test_the_stats_name_the_fields_transformers_filled():
    pytest.importorskip("transformers")
    config = dict(model_type="mistral", **TINY)
    config["num_attention_heads"] = 8
    result = estimate(config=config, device="H100-80GB")
    assert "num_key_value_heads=8" in result.stats.config_defaults


@pytest.mark.parametrize("name, config", [
    ("deepseek moe_layer_freq is ignored, as transformers' modeling does",
     dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=100,
          intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
          num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=2, kv_lora_rank=16, q_lora_rank=24,
          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1)),
    ("qwen2_moe qkv_bias off", dict(model_type="qwen2_moe", **TINY, num_key_value_heads=4, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                    qkv_bias=False)),
    ("tied phi keeps its head bias", dict(model_type="phi", **TINY, tie_word_embeddings=True)),
    ("opt LayerNorms without weights", dict(model_type="opt", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                            vocab_size=100, ffn_dim=96, max_position_embeddings=128,
                                            layer_norm_elementwise_affine=False)),
])
def test_structure_follows_the_transformers_meta_build(name, config):
    pytest.importorskip("transformers")
    assert stats_from_config(config).params == hf_meta.stats_from_transformers(config).params


@pytest.mark.parametrize("change, field", [
    (dict(num_key_value_heads=64), "num_key_value_heads = 64 exceeds"),
    (dict(num_key_value_heads=7), "num_key_value_heads = 7 must divide"),
    (dict(num_local_experts=8, num_experts_per_tok=16), "num_experts_per_tok = 16"),
    (dict(hidden_size=10**9, num_hidden_layers=10**6), r"hidden_size = 1e\+09 and num_hidden_layers = 1e\+06"),
])
def test_nonsense_is_refused_by_field(change, field, monkeypatch):
    _without_transformers(monkeypatch)
    config = {**dict(model_type="mixtral" if "num_local_experts" in change else "llama", hidden_size=4096,
                     num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256,
                     intermediate_size=14336), **change}
    with pytest.raises(EstimatorInputError, match=field):
        stats_from_config(config)


LLAMA_TEXT = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=8, num_hidden_layers=4, vocab_size=1100)
LLAVA = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA_TEXT,
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                           "num_attention_heads": 4, "num_hidden_layers": 2, "image_size": 56, "patch_size": 14,
                           "projection_dim": 64}, "image_token_index": 1050}


def test_a_multimodal_config_models_its_language_model_and_names_its_vision_tower():
    pytest.importorskip("transformers")
    kw = dict(device="H100-80GB", micro_batch=1, seq_len=256)
    llava, llama = estimate(config=LLAVA, **kw), estimate(config=LLAMA_TEXT, **kw)
    assert llava.plan("ddp").activations == llama.plan("ddp").activations > 0
    assert llava.plan("ddp").buffers["logits_and_loss"] == llama.plan("ddp").buffers["logits_and_loss"] > 0
    assert llava.max_micro_batch is None and llama.max_micro_batch > 1 and not llava.activations_estimated
    assert any("vision tower" in warning for warning in llava.warnings)
    unbounded = llava.plan("ddp").confidence.unbounded
    assert any("vision tower" in part for part in unbounded)


def test_an_architecture_without_an_activation_model_is_unbounded_not_zero():
    pytest.importorskip("transformers")
    mamba = dict(model_type="mamba", hidden_size=64, num_hidden_layers=2, vocab_size=100, state_size=4)
    result = estimate(config=mamba, device="H100-80GB", micro_batch=1, seq_len=256)
    assert result.activation_source == "not estimated" and result.max_micro_batch is None
    assert any("mamba's activations" in warning for warning in result.warnings)
    assert any("not attention blocks" in part for part in result.plan("ddp").confidence.unbounded)


T5 = dict(model_type="t5", architectures=["T5ForConditionalGeneration"], d_model=64, d_ff=256, d_kv=16, num_heads=4,
          num_layers=2, num_decoder_layers=3, vocab_size=200, feed_forward_proj="relu", dropout_rate=0.0,
          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def test_an_encoder_decoder_keeps_both_stacks():
    """t5: encoder self-attention blocks plus decoder blocks with cross-attention, by hand (fp32, unfused)."""
    pytest.importorskip("transformers")
    arch = stats_from_config(T5).architecture
    assert (arch.layers, arch.cross_attention, arch.encoder.layers, arch.encoder.lm_head) == (3, True, 2, False)
    s, c, h, a, d, f = 128, 4, 64, 4, 16, 256
    attention = c * h + c * 3 * a * d + c * a * d + c * a * s      # inputs, q/k/v, out-proj input, softmax
    mlp = c * h + 2 * c * f
    norm = 8 * h                                                   # fp32 RMS-style input + output
    encoder_layer, decoder_layer = 2 * norm + attention + mlp, 3 * norm + 2 * attention + mlp
    outside = norm + c * h                                         # final norm and the stack's output
    expected = s * (2 * encoder_layer + 3 * decoder_layer + 2 * outside)
    got = activation_profile(arch, ActivationInputs(1, s, fused_attention=False, fp32_activations=True)).stored
    assert got == expected


def test_an_encoder_decoder_against_what_torch_saves():
    """The saved-for-backward storages of a real tiny T5 forward: at most 15% over (a ReLU MLP keeps one
    tensor where the formula's plain MLP keeps two), never under as one stack was (58%)."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.AutoConfig.for_model(**{k: v for k, v in T5.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="eager").train()
    ids = torch.randint(2, 200, (1, 128))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    real = sum(size for ptr, size in seen.items() if ptr not in params)
    result = estimate(config=T5, precision="fp32", micro_batch=1, seq_len=128, fused_attention=False,
                      device="H100-80GB")
    plan = result.plan("ddp")
    modelled = plan.activations + plan.buffers.get("logits_and_loss", 0)
    assert 0 <= (modelled - real) / real < 0.15
