"""Tiny Hugging Face models, their data, and the rank workers of the pretrained-weights tests.

Every worker runs on a pool rank (``rank_pools.get(n).run(fn, ...)``) or in
process (``run_local``); rank and world size come from the process group.
Nothing is downloaded: the "pretrained" folders are written by
``make_pretrained`` from a seeded, CPU-built model.

[Note: the reference]
A rank trains on its slice of a global batch; the reference, in the test
process, is the unwrapped model loaded with ``from_pretrained`` and trained
on the whole global batch with the same optimizer. Every rank's slice has the
same number of tokens (no padding), so the reference's mean loss is the mean
of the ranks' losses and the averaged gradients agree.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

import torch

import shardengine as se
from rank_pool import rank_world
from toy_models import make_optimizer

warnings.filterwarnings("ignore", message=".*(bos|eos|pad)_token_id.*")
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

GLOBAL_BATCH, SEQ, TARGET_SEQ, LR = 6, 8, 5, 0.1


# --------------------------------------------------------------------------- models


def config(family: str, **overrides: Any):
    """A tiny config of ``family`` (gpt2: tied embeddings; t5: encoder-decoder; llama; bert), no dropout."""
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=1, eos_token_id=2)
    elif family == "t5":
        cfg = transformers.T5Config(d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2, vocab_size=64,
                                    dropout_rate=0.0, relative_attention_num_buckets=8,
                                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    elif family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                       bos_token_id=1, eos_token_id=2)
    else:
        raise ValueError(f"unknown family {family}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "t5": "T5ForConditionalGeneration", "llama": "LlamaForCausalLM",
                 "llama-base": "LlamaModel"}


def build(family: str, device: Optional[str] = None, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The model of ``family`` built from its config (on ``device``: "meta" for a meta model)."""
    cls = getattr(transformers, MODEL_CLASSES[family])
    cfg = config(family.removesuffix("-base"), **overrides)
    torch.manual_seed(seed)
    if device is None:
        return cls(cfg)
    with torch.device(device):
        return cls(cfg)


def load(family: str, folder: str) -> torch.nn.Module:
    return getattr(transformers, MODEL_CLASSES[family]).from_pretrained(folder)


def make_pretrained(family: str, folder: str, seed: int = 1, max_shard_size: str = "50GB") -> dict:
    """Write a seeded CPU-built model as ``save_pretrained`` does; return its state dict."""
    model = build(family, seed=seed)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return {k: v.clone() for k, v in model.state_dict().items()}


def inputs(family: str, step: int, rows: slice = slice(None), vocab: int = 64) -> dict[str, torch.Tensor]:
    """Step ``step``'s global batch (``rows`` of it): token ids, and labels for the loss."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (GLOBAL_BATCH, SEQ), generator=generator)
    if family == "t5":
        labels = torch.randint(3, vocab, (GLOBAL_BATCH, TARGET_SEQ), generator=generator)
        return {"input_ids": ids[rows], "labels": labels[rows]}
    return {"input_ids": ids[rows], "labels": ids[rows]}


def my_rows() -> slice:
    rank, world = rank_world()
    per_rank = GLOBAL_BATCH // world
    return slice(rank * per_rank, (rank + 1) * per_rank)


# The optimizer factory (params -> optimizer) of these tests. SGD with momentum: Adam would blow
# up float noise in gradients that are zero in exact arithmetic (GPT-2's key bias), which says
# nothing about the engine.
optimizer_factory = functools.partial(make_optimizer, name="sgd_momentum", lr=LR)


def train(model, optimizer, family: str, steps: int, rows: slice = slice(None)) -> list[float]:
    losses = []
    for step in range(steps):
        vocab = getattr(model, "module", model).config.vocab_size
        loss = model(**inputs(family, step, rows, vocab)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def reference(family: str, folder: str, steps: int) -> tuple[dict, list[float]]:
    """The unwrapped model loaded with from_pretrained and trained on the global batch."""
    torch.manual_seed(0)
    model = load(family, folder)
    model.train()
    losses = train(model, optimizer_factory(model.parameters()), family, steps)
    return model.state_dict(), losses


# --------------------------------------------------------------------------- workers


def load_train_save(family: str, source: str, out_root: str, stages: list[int], steps: int,
                    options: Optional[dict] = None) -> dict:
    """Per stage: build (on meta at stage 3), load ``source``, train, save to out_root/stage<s>."""
    torch.set_num_threads(1)
    losses = {}
    for stage in stages:
        net = build(family, device="meta" if stage == 3 else None)
        model, sharded_optimizer = se.shard(net, optimizer_factory, stage=stage, **(options or {}))
        se.load_pretrained(model, source)
        losses[stage] = train(model, sharded_optimizer, family, steps, my_rows())
        se.save_pretrained(model, os.path.join(out_root, f"stage{stage}"), max_shard_size="8KB")
    return losses


def load_then_save(family: str, source: str, out: str, stage: int, options: dict) -> dict:
    """Load and save straight away; report the bytes each rank read."""
    torch.set_num_threads(1)
    net = build(family, device="meta" if stage == 3 else None)
    model, _ = se.shard(net, lambda params: torch.optim.AdamW(params), stage=stage, **options)
    report = se.load_pretrained(model, source)
    masters = [b.master.detach().dtype for b in model.engine.buckets if b.master is not None]
    files = se.save_pretrained(model, out, max_shard_size="8KB")
    return {"bytes_read": report.bytes_read, "master_dtypes": sorted({str(d) for d in masters}),
            "param_dtypes": sorted({str(p.dtype) for p in net.parameters()}), "files": files}


def bad_loads(family: str, stage: int, good: str, bad: dict[str, str]) -> dict:
    """Load each bad path after ``good``: the error on this rank, and whether the model is untouched."""
    torch.set_num_threads(1)
    net = build(family, device="meta" if stage == 3 else None)
    model, _ = se.shard(net, lambda params: torch.optim.AdamW(params), stage=stage)
    se.load_pretrained(model, good)
    before = model.full_state_dict()
    outcome = {}
    for case, path in bad.items():
        try:
            se.load_pretrained(model, path)
            outcome[case] = {"error": None}
        except se.errors.CheckpointError as error:
            outcome[case] = {"error": str(error)}
        after = model.full_state_dict()
        outcome[case]["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    return outcome


def meta_init_then_train(family: str, steps: int, overrides: dict) -> dict:
    """Build on meta, shard at stage 3 (the model's own init, unit by unit), train ``steps``."""
    torch.set_num_threads(1)
    rank, _ = rank_world()
    net = build(family, device="meta", seed=100 + rank, **overrides)  # rank 0's init is broadcast
    model, sharded_optimizer = se.shard(net, optimizer_factory, stage=3)
    initial = model.full_state_dict()
    buffers = {name: b.clone() for name, b in net.named_buffers()}
    losses = train(model, sharded_optimizer, family, steps, my_rows())
    return {"initial": initial, "buffers": buffers, "final": model.full_state_dict(), "losses": losses}
