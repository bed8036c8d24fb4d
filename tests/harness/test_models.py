"""Reference models (shardengine.testing.models) and the example's generated corpus."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from shardengine.testing.models import GPT, MLP, GPTConfig, build_gpt, build_mlp, example_inputs, lm_loss

CORPUS_PATH = Path(__file__).resolve().parents[2] / "examples" / "data" / "corpus.py"


@pytest.fixture(scope="module")
def corpus():
    """examples/data/corpus.py, loaded by path (examples/ is not a package on sys.path)."""
    spec = importlib.util.spec_from_file_location("shardengine_example_corpus", CORPUS_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unique_numel(module: torch.nn.Module) -> int:
    """Parameters counted once each, however many modules share them."""
    seen = {id(p): p.numel() for _, p in module.named_parameters(remove_duplicate=False)}
    return sum(seen.values())


@pytest.mark.parametrize("preset", GPTConfig.preset_names())
def test_num_params_is_exact_for_presets(preset):
    cfg = GPTConfig.preset(preset, vocab_size=97)
    with torch.device("meta"):
        model = GPT(cfg)
    assert cfg.num_params() == unique_numel(model)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_num_params_is_exact_for_variants(bias, tie):
    cfg = GPTConfig(vocab_size=51, seq_len=17, n_layer=3, n_head=3, n_embd=24, bias=bias, tie_embeddings=tie)
    model = GPT(cfg)
    assert cfg.num_params() == unique_numel(model) == sum(p.numel() for p in model.parameters())


def test_preset_sizes_match_their_names():
    sizes = {"1m": 0.8e6, "10m": 10e6, "27m": 27e6, "50m": 50e6, "100m": 100e6}
    for name, approx in sizes.items():
        cfg = GPTConfig.preset(name, vocab_size=0, seq_len=0)
        assert abs(cfg.num_params() - approx) / approx < 0.1, (name, cfg.num_params())


def test_tied_embedding_shares_storage():
    model = build_gpt("tiny", vocab_size=40)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    untied = GPT(GPTConfig.preset("tiny", vocab_size=40, tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()


def test_builds_and_runs_on_meta_device():
    with torch.device("meta"):
        model = build_gpt("100m", vocab_size=50304)
        idx = torch.zeros(2, 16, dtype=torch.long)
    assert all(p.is_meta for p in model.parameters())
    assert model(idx).shape == (2, 16, 50304)


def test_meta_model_materializes_like_a_cpu_model():
    with torch.device("meta"):
        meta_model = build_gpt("tiny", vocab_size=30)
        half_meta = build_gpt("tiny", vocab_size=30)
    meta_model.to_empty(device="cpu")
    meta_model.reset_parameters()
    half_meta.blocks[1].to_empty(device="cpu")  # materialize one unit only, as stage 3 may
    half_meta.reset_parameters()
    cpu_model = build_gpt("tiny", vocab_size=30)
    for a, b in zip(meta_model.state_dict().values(), cpu_model.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(half_meta.blocks[1].state_dict().values(), cpu_model.blocks[1].state_dict().values()):
        assert torch.equal(a, b)
    assert meta_model.lm_head.weight is meta_model.tok_emb.weight


def test_init_is_deterministic_and_scales_residual_projections():
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=8, n_head=4, n_embd=256)
    torch.manual_seed(0)
    a = GPT(cfg)
    torch.manual_seed(1)  # the global RNG does not matter, the model's seed does
    b = GPT(cfg)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)
    assert not torch.equal(a.tok_emb.weight, GPT(cfg, seed=1).tok_emb.weight)
    residual = a.blocks[0].mlp.out_proj.weight.std().item()
    assert residual == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert a.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(a.blocks[0].attn.qkv.bias) == 0


def test_forward_shapes_loss_and_length_check():
    model = build_gpt("tiny", vocab_size=50, seq_len=32)
    idx, targets = example_inputs(micro_batch=3, seq_len=32, vocab_size=50)
    assert idx.dtype == targets.dtype == torch.long
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    logits = model(idx)
    assert logits.shape == (3, 32, 50)
    loss = GPT.loss(logits, targets)
    assert loss.item() == pytest.approx(math.log(50), rel=0.05)  # near-uniform at init
    assert torch.equal(model(idx, targets), loss)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_config_is_frozen_and_validated():
    cfg = GPTConfig.preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 3
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=10, seq_len=8, n_layer=1, n_head=3, n_embd=16)
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.preset("huge")


def test_mlp_with_prime_sizes():
    model = build_mlp((31, 97, 13, 7))
    assert model.num_params() == unique_numel(model) == 31 * 97 + 97 + 97 * 13 + 13 + 13 * 7 + 7
    assert model(torch.randn(5, 31)).shape == (5, 7)
    assert MLP([3, 1], bias=False).num_params() == 3
    with pytest.raises(ValueError):
        MLP([4])


def test_corpus_is_deterministic(corpus):
    text = corpus.generate_corpus()
    assert text == corpus.generate_corpus()
    assert len(text) == 300_000
    # Pinned: a change here means every checkout trains on different text.
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "d0d649b28c6072ad"
    assert corpus.generate_corpus(seed=1) != text


def test_tokenizer_round_trip_and_batches(corpus):
    tok, train, val = corpus.load_corpus()
    assert tok.vocab_size < 64 and len(val) * 9 == pytest.approx(len(train), rel=0.01)
    assert tok.decode(tok.encode("The miller.")) == "The miller."
    x, y = corpus.get_batch(train, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_loss_decreases_with_plain_training(corpus):
    tok, train, _ = corpus.load_corpus()
    torch.manual_seed(0)
    model = build_gpt("tiny", vocab_size=tok.vocab_size, seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        idx, targets = corpus.get_batch(train, 16, 64, gen)
        loss = lm_loss(model(idx), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 3.3
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8, losses
