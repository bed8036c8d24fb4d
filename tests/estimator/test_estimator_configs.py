"""Exact parameter counts from config.json fixtures written from published architecture facts."""
import json
from pathlib import Path

import pytest

from memory_estimator.errors import EstimatorInputError
from memory_estimator.model.hf_config import SUPPORTED_MODEL_TYPES, stats_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# Published totals (model cards / papers), each also re-derived by hand from the architecture.
PUBLISHED_COUNTS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-70b": 68_976_648_192,
    "mistral-7b-v0.1": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "gpt2": 124_439_808,           # tied head, 1024×768 learned positions included
    "gpt2-medium": 354_823_168,
    "gpt-neox-20b": 20_554_567_680,  # GPT-NeoX-20B paper
    "pythia-70m": 70_426_624,      # Pythia paper, total incl. embeddings
    "gemma-7b": 8_537_680_896,     # tied, head_dim 256
    "gemma-2b": 2_506_172_416,     # multi-query attention (1 KV head)
    "phi-2": 2_779_683_840,        # untied head with bias, one LayerNorm per block
    "qwen2-7b": 7_615_616_512,     # q/k/v biases, untied
    "qwen2-0.5b": 494_032_768,     # q/k/v biases, tied
    "qwen3-8b": 8_190_735_360,     # q/k norms, no biases
    "qwen3-0.6b": 596_049_920,     # tied
    "qwen1.5-moe-a2.7b": 14_315_784_192,   # 60 experts + a gated shared expert
    "qwen3-30b-a3b": 30_532_122_624,       # 128 experts, no shared expert
    "gemma-2-9b": 9_241_705_984,   # four norms per block
    "phi-3-mini-4k": 3_821_079_552,        # fused qkv and gate_up projections
    "falcon-7b": 6_921_720_704,    # multi-query, parallel attention, one LayerNorm
    "opt-1.3b": 1_315_758_080,
    "opt-350m": 331_196_416,       # 512-wide embeddings projected in and out, no final norm
    "bloom-560m": 559_214_592,     # LayerNorm after the embedding, ALiBi
    "starcoder2-7b": 7_173_923_840,
    "olmo-7b": 6_888_095_744,      # parameter-free LayerNorms
    "olmo-2-7b": 7_298_617_344,    # post-norms, full-width q/k norms
    "deepseek-v2-lite": 15_706_484_224,    # latent attention, 64 routed + 2 shared experts
    "bert-large-uncased": 335_174_458,     # BertForMaskedLM: the MLM head ties the decoder
}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED_COUNTS.items()))
def test_exact_parameter_count(name, count):
    assert stats_from_config(CONFIGS / f"{name}.json").params == count


def test_every_supported_family_has_a_fixture():
    families = {json.loads(p.read_text())["model_type"] for p in CONFIGS.glob("*.json")}
    assert families == set(SUPPORTED_MODEL_TYPES)


def test_llama_block_and_architecture_facts():
    stats = stats_from_config(CONFIGS / "llama-2-7b.json")
    assert stats.largest_unit == 202_383_360  # 4·4096² + 3·4096·11008 + 2·4096
    assert (stats.architecture.layers, stats.architecture.hidden,
            stats.architecture.heads, stats.architecture.vocab) == (32, 4096, 32, 32000)


def test_tying_removes_exactly_one_embedding():
    config = json.loads((CONFIGS / "llama-2-7b.json").read_text())
    tied = stats_from_config({**config, "tie_word_embeddings": True}).params
    assert PUBLISHED_COUNTS["llama-2-7b"] - tied == 32000 * 4096


def test_grouped_query_attention_shrinks_k_and_v_only():
    config = json.loads((CONFIGS / "mistral-7b-v0.1.json").read_text())
    full_kv = stats_from_config({**config, "num_key_value_heads": 32}).params
    assert full_kv - PUBLISHED_COUNTS["mistral-7b-v0.1"] == 32 * 2 * 4096 * (4096 - 1024)


def test_mixtral_largest_unit_is_a_block_with_all_experts_and_router():
    assert stats_from_config(CONFIGS / "mixtral-8x7b.json").largest_unit == (
        2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096)


def test_embedding_is_the_largest_unit_when_larger_than_a_block():
    assert stats_from_config(CONFIGS / "gemma-2b.json").largest_unit == 256000 * 2048


def test_llama_attention_bias_adds_qkvo_biases():
    config = json.loads((CONFIGS / "llama-2-7b.json").read_text())
    with_bias = stats_from_config({**config, "attention_bias": True}).params
    assert with_bias - PUBLISHED_COUNTS["llama-2-7b"] == 32 * 4 * 4096


def test_deepseek_v3_counts_every_expert_of_its_58_moe_layers():
    stats = stats_from_config(CONFIGS / "deepseek-v3.json")
    # The published 671,026,419,200 also counts each MoE layer's 256-element router
    # score-correction bias, which transformers keeps as a buffer, not a parameter.
    assert stats.params == 671_026_419_200 - 58 * 256
    assert stats.architecture.experts == 256 and stats.architecture.moe_layers == 58


def test_moe_and_gqa_facts_reach_the_activation_model():
    qwen = stats_from_config(CONFIGS / "qwen1.5-moe-a2.7b.json").architecture
    assert (qwen.experts, qwen.experts_per_token, qwen.mlp_width, qwen.shared_expert_width) == (60, 4, 1408, 5632)
    llama3 = stats_from_config(CONFIGS / "qwen3-8b.json").architecture
    assert (llama3.kv, llama3.dim, llama3.gated_mlp, llama3.norm, llama3.dropout) == (8, 128, True, "rmsnorm", False)


def test_bert_head_follows_its_architectures_entry():
    config = json.loads((CONFIGS / "bert-large-uncased.json").read_text())
    classifier = stats_from_config({**config, "architectures": ["BertForSequenceClassification"], "num_labels": 2})
    assert classifier.params == 335_141_888 + 1024 * 2 + 2  # encoder, pooler and a 2-label classifier
    assert not classifier.architecture.lm_head


def test_missing_field_names_it():
    with pytest.raises(EstimatorInputError, match="missing 'intermediate_size'"):
        stats_from_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                           "num_hidden_layers": 2, "vocab_size": 10})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(EstimatorInputError, match="config file not found"):
        stats_from_config(tmp_path / "nope.json")
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama",')
    with pytest.raises(EstimatorInputError, match="malformed JSON"):
        stats_from_config(broken)
    broken.write_text("[1, 2]")
    with pytest.raises(EstimatorInputError, match="JSON object"):
        stats_from_config(tmp_path)  # a directory means its config.json


def test_negative_sizes_rejected():
    config = json.loads((CONFIGS / "gpt2.json").read_text())
    with pytest.raises(EstimatorInputError, match="n_embd must be at least 1"):
        stats_from_config({**config, "n_embd": -768})
