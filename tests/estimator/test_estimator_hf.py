"""transformers, when installed: any model_type on the meta device, the hand-written families
held against it, and a Hugging Face model's own loss traced from keyword inputs."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from memory_estimator import estimate
from memory_estimator.model.hf_config import stats_from_config
from memory_estimator.terms.activations import ActivationInputs, activation_profile
from memory_estimator.cli.command import main

transformers = pytest.importorskip("transformers")

from memory_estimator.model.hf_meta import stats_from_transformers  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_hand_written_family_equals_transformers_meta_build(path):
    config = json.loads(path.read_text())
    hand, meta = stats_from_config(config), stats_from_transformers(config)
    assert hand.params == meta.params
    if not hand.architecture.experts:  # transformers 5 fuses each layer's experts into 3-D tensors
        assert hand.largest_tensor == meta.largest_tensor
    if meta.block_params is not None:
        assert hand.block_params == meta.block_params


def test_a_model_type_without_a_family_is_built_by_transformers():
    t5_small = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 512, "d_ff": 2048,
                "d_kv": 64, "num_heads": 8, "num_layers": 6, "vocab_size": 32128}
    stats = stats_from_config(t5_small)
    assert stats.params == 60_506_624 and stats.source == "config:t5 (transformers)"  # t5-small's model card
    assert estimate(config=t5_small, device="T4").recommended == "ddp"


TINY_LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=688, vocab_size=512, max_position_embeddings=512)


def build_tiny_llama():
    import transformers as hf

    return hf.LlamaForCausalLM(hf.AutoConfig.for_model(**TINY_LLAMA))


def _ids_and_labels(micro_batch: int, seq_len: int) -> dict:
    import torch

    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def test_analytic_layer_bytes_match_a_traced_hugging_face_llama():
    """Per layer, the analytic formula (gated MLP, GQA, RMSNorm's fp32 upcast) is what the trace sees."""
    import torch

    from memory_estimator.model.module import load_module, traced_activation_bytes

    traced, analytic = {}, {}
    for layers in (2, 4):
        config = {**TINY_LLAMA, "num_hidden_layers": layers}
        build = lambda: transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**config))  # noqa: E731
        traced[layers] = traced_activation_bytes(load_module(build).module, _ids_and_labels, 2, 256, torch.bfloat16)
        analytic[layers] = activation_profile(stats_from_config(config).architecture, ActivationInputs(2, 256)).stored
    per_layer_traced = (traced[4] - traced[2]) / 2
    per_layer_analytic = (analytic[4] - analytic[2]) / 2
    assert abs(per_layer_traced - per_layer_analytic) / per_layer_analytic < 0.03


def test_module_from_a_local_factory_file_with_keyword_inputs(tmp_path, monkeypatch, capsys):
    factory = tmp_path / "my_llama.py"
    factory.write_text(textwrap.dedent(f"""
        import torch, transformers

        def build():
            return transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**{TINY_LLAMA!r}))

        def example_inputs(micro_batch, seq_len):
            ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
            return {{"input_ids": ids, "labels": ids}}
    """))
    by_path = estimate(module=f"{factory}:build", micro_batch=4, seq_len=256, device="cpu",
                       device_memory_bytes=10**12)
    assert by_path.activation_source == "traced" and by_path.plan("zero3").activations > 0
    monkeypatch.chdir(tmp_path)  # the current directory is importable, as for `python -c`
    assert main(["--module", "my_llama:build", "--seq-len", "64", "--device", "cpu", "--gpu-memory", "64GiB",
                 "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["params"] == by_path.params
