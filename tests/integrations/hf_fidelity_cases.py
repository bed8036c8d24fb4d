"""Rank workers with tiny Hugging Face models (transformers is an optional extra)."""

from __future__ import annotations

import copy
import tempfile

import torch

import shardengine as se
from engine_cases import _single_thread, rel_err
from rank_pool import rank_world


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=1, pad_token_id=1, loss_type="ForCausalLMLoss")
    return GPT2LMHeadModel(config)


def hf_attributes_and_generate(spec: dict) -> dict:
    """``model.config`` / ``.device`` / ``.generate`` on the wrapped model; saving inside summon."""
    from transformers import GPT2LMHeadModel
    _single_thread()
    rank, world = rank_world()
    net = tiny_gpt2()
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=spec["stage"])
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    results = {"config": model.config.n_embd, "device": str(model.device),
               "tied": model.config.tie_word_embeddings}
    prompt = torch.tensor([[2, 3, 4]])
    model.eval()
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=1)
    reference = tiny_gpt2()
    reference.load_state_dict(model.state_dict())
    reference.eval()
    expected = reference.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=1)
    results["generate_equal"] = torch.equal(generated, expected)
    full = model.state_dict()
    with tempfile.TemporaryDirectory() as directory:
        with model.summon_full_params():  # every rank calls it; transformers writes on rank 0
            model.module.save_pretrained(directory)
        if rank == 0:
            loaded = GPT2LMHeadModel.from_pretrained(directory)
            results["save_pretrained_error"] = max(rel_err(v, full[k]) for k, v in loaded.state_dict().items()
                                                   if k in full)
    return results


def fp16_gradients_of_hf_loss(spec: dict) -> dict:
    """fp16 loss scaling with HF's (loss, logits) outputs: gradients scaled exactly once."""
    _single_thread()
    net = tiny_gpt2()
    ref = copy.deepcopy(net)
    model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.0), stage=spec["stage"],
                        param_dtype="fp16")
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    with model.summon_full_params(with_grads=True):
        ratios = [float(p.grad.float().norm() / r.grad.norm()) for p, r in zip(net.parameters(), ref.parameters())
                  if r.grad is not None and float(r.grad.norm()) > 1e-3]
    return {"ratios": ratios}


def generate_matches_unwrapped(spec: dict) -> dict:
    """``model.generate`` (and a directly called encoder) give the unwrapped model's results."""
    import hf_cases as cases
    _single_thread()
    net = cases.build(spec["family"])
    reference = cases.build(spec["family"])
    reference.load_state_dict(net.state_dict())
    model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.0), stage=spec["stage"])
    model.eval()
    reference.eval()
    ids = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    got = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    want = reference.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    results = {"generate_equal": torch.equal(got, want), "tokens": got.shape[-1]}
    if spec["family"] == "t5":
        with torch.no_grad():
            encoded = model.encoder(input_ids=ids).last_hidden_state
            results["encoder_error"] = rel_err(encoded, reference.encoder(input_ids=ids).last_hidden_state)
    return results
