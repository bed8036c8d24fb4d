"""PEFT (LoRA) on tiny Hugging Face models: rank workers of the fine-tuning tests.

Each worker builds the model from a tiny config (nothing downloaded), wraps it
with ``peft.get_peft_model``, trains it sharded on its rows of the global batch
and, in the same process, an unwrapped deep copy on the whole global batch
(see [Note: the reference] in hf_cases.py), and reports the relative error of
every adapter parameter.
"""

from __future__ import annotations

import copy
import os

import torch

import shardengine as se
from engine_cases import _single_thread, rel_err
from hf_cases import build, inputs, my_rows

import peft  # noqa: E402

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
STEPS = 3


def make_optimizer(params, name: str) -> torch.optim.Optimizer:
    """AdamW, or SGD for the bf16 comparisons: Adam's update is about lr * sign(g) wherever
    |g| is small, so a rounding-level difference in a near-zero gradient becomes a whole
    step and the comparison would measure Adam, not the engine."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def peft_model(family: str, base_dtype: torch.dtype = torch.float32, seed: int = 0, modules_to_save=None):
    """``get_peft_model`` over a tiny ``family`` model; B is random too, so every adapter
    parameter gets a gradient at the first step (peft's default zero B would not).
    ``modules_to_save``: peft's trained copies of whole modules (a head beside the adapters)."""
    base = build(family, seed=seed)
    if base_dtype != torch.float32:
        base = base.to(base_dtype)  # peft keeps the adapters in fp32 (autocast_adapter_dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[family],
                             init_lora_weights=False, fan_in_fan_out=family == "gpt2",
                             modules_to_save=modules_to_save)
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(base, config)


def _step(model, optimizer, family: str, step: int, rows: slice) -> float:
    vocab = model.config.vocab_size
    loss = model(**inputs(family, step, rows, vocab)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _bf16_reference_step(ref, compute, optimizer, family: str, step: int) -> float:
    """One step as param_dtype="bf16" defines it: bf16 forward/backward, fp32 masters."""
    with torch.no_grad():
        for master, low in zip(ref.parameters(), compute.parameters()):
            low.copy_(master)
    loss = compute(**inputs(family, step, slice(None), ref.config.vocab_size)).loss
    loss.backward()
    for master, low in zip(ref.parameters(), compute.parameters()):
        master.grad = None if low.grad is None else low.grad.float()
        low.grad = None
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train_peft_and_compare(spec: dict) -> dict:
    """spec: family, stage, modules_to_save, checkpointing (None / "reentrant" / "non_reentrant"),
    param_dtype (None / "bf16"), base_dtype ("fp32" / "bf16"), optimizer ("adamw" / "sgd"),
    activations (shard()'s activation keywords: the engine checkpoints/offloads the layers)."""
    _single_thread()
    family = spec["family"]
    base_dtype = torch.bfloat16 if spec.get("base_dtype") == "bf16" else torch.float32
    model = peft_model(family, base_dtype, modules_to_save=spec.get("modules_to_save"))
    model.train()
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": spec["checkpointing"] == "reentrant"})
    ref = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    wrapped, optimizer = se.shard(model, make_optimizer(trainable, spec.get("optimizer", "adamw")), stage=spec["stage"],
                                  param_dtype=spec.get("param_dtype"), **spec.get("activations", {}))
    ref_trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_optimizer = make_optimizer(ref_trainable, spec.get("optimizer", "adamw"))
    compute = None
    if spec.get("param_dtype") == "bf16":
        compute = copy.deepcopy(ref).to(torch.bfloat16)
    losses, ref_losses = [], []
    for step in range(STEPS):
        losses.append(_step(wrapped, optimizer, family, step, my_rows()))
        if compute is None:
            ref_losses.append(_step(ref, ref_optimizer, family, step, slice(None)))
        else:
            ref_losses.append(_bf16_reference_step(ref, compute, ref_optimizer, family, step))
    full = wrapped.state_dict()
    expected = {k: v for k, v in ref.state_dict().items()}
    names = {id(p): n for n, p in ref.named_parameters()}
    trained = {names[id(p)] for p in ref_trainable}
    return {"adapter_errors": {k: rel_err(full[k], expected[k]) for k in trained},
            # with param_dtype the frozen base is held in the compute dtype only (never stepped)
            "frozen_equal": all(torch.equal(full[k], expected[k].to(full[k].dtype))
                                for k in expected if k not in trained),
            "all_moved": all(not torch.equal(full[k], initial[k]) for k in trained),
            "trained": len(trained), "losses": losses, "ref_losses": ref_losses}


# --------------------------------------------------------------------------- saving the adapter


def _logits(model, family: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(family, 99, slice(None), 64)).logits


def save_and_reload_adapter(spec: dict) -> dict:
    """Train 2 steps, ``model.save_pretrained(folder)`` (the adapter, by peft), reload it with
    ``PeftModel.from_pretrained`` over a fresh base, and merge it; compare with the reference.

    spec: family, stage, folder, param_dtype (None / "bf16").
    """
    _single_thread()
    family = spec["family"]
    model = peft_model(family)
    model.train()
    ref = copy.deepcopy(model)
    wrapped, optimizer = se.shard(model, make_optimizer([p for p in model.parameters() if p.requires_grad], "sgd"),
                                  stage=spec["stage"], param_dtype=spec.get("param_dtype"))
    ref_optimizer = make_optimizer([p for p in ref.parameters() if p.requires_grad], "sgd")
    for step in range(2):
        _step(wrapped, optimizer, family, step, my_rows())
        _step(ref, ref_optimizer, family, step, slice(None))
    adapter_bytes = sum(b.param_nbytes for b in wrapped.engine.buckets if b.requires_grad)
    before = wrapped.comm_stats().snapshot()
    wrapped.save_pretrained(spec["folder"])
    moved = wrapped.comm_stats().since(before)
    files = sorted(os.listdir(spec["folder"]))
    from safetensors.torch import load_file

    saved = load_file(os.path.join(spec["folder"], "adapter_model.safetensors"))
    base = build(family, seed=0)  # the same frozen base peft_model() started from
    loaded = peft.PeftModel.from_pretrained(base, spec["folder"])
    ref.eval()
    loaded.eval()
    want = _logits(ref, family)
    got = _logits(loaded, family)
    merged = copy.deepcopy(loaded).merge_and_unload()
    with wrapped.summon_full_params(writeback=False):
        consolidated = copy.deepcopy(wrapped)  # a plain PeftModel with the trained values
    consolidated.eval()
    consolidated_merged = consolidated.merge_and_unload()
    return {"files": files, "saved_keys": sorted(saved), "gathered_bytes": moved.bytes_total,
            "adapter_bytes": adapter_bytes, "reload_err": rel_err(got, want),
            "merged_err": rel_err(_logits(merged, family), want),
            "consolidated_merged_err": rel_err(_logits(consolidated_merged, family), want),
            "merged_type": type(consolidated_merged).__name__}


# --------------------------------------------------------------------------- model.save_pretrained


def wrapped_save_pretrained(spec: dict) -> dict:
    """``model.save_pretrained(folder)`` on a wrapped (non-PEFT) HF model after a step, beside
    ``se.save_pretrained``; and the arguments it refuses. spec: family, stage, root."""
    import transformers

    from hf_cases import MODEL_CLASSES

    _single_thread()
    family = spec["family"]
    net = build(family, seed=3)
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"])
    _step(model, optimizer, family, 0, my_rows())
    method, function = os.path.join(spec["root"], "method"), os.path.join(spec["root"], "function")
    model.save_pretrained(method, max_shard_size="8KB", is_main_process=se.distributed.is_main_process())
    se.save_pretrained(model, function, max_shard_size="8KB")
    refused = {}
    for name, value in [("push_to_hub", True), ("state_dict", {}), ("safe_serialization", False),
                        ("variant", "fp16"), ("unknown_option", 1)]:
        try:
            model.save_pretrained(os.path.join(spec["root"], "refused"), **{name: value})
            refused[name] = None
        except se.ConfigError as error:
            refused[name] = str(error)
    cls = getattr(transformers, MODEL_CLASSES[family])
    written = cls.from_pretrained(method).state_dict()
    expected = cls.from_pretrained(function).state_dict()
    return {"equal": sorted(written) == sorted(expected) and all(torch.equal(written[k], expected[k])
                                                                 for k in expected),
            "trained": model.state_dict(), "written": written, "refused": refused,
            "exists_refused": os.path.exists(os.path.join(spec["root"], "refused")),
            "files": sorted(os.listdir(method))}
