"""QLoRA (a bitsandbytes NF4 or int8 base with LoRA adapters) sharded at stage 3: rank workers.

The reference (``reference``, in the test process) is bitsandbytes QLoRA as users run
it in one process: ``from_pretrained`` with a ``BitsAndBytesConfig`` on the CPU (bitsandbytes
0.50 runs NF4 and int8 there), ``peft.get_peft_model`` under a seed, AdamW on the whole
global batch. The workers run the same model sharded at stage 3, each on its rows.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

import shardengine as se
from engine_cases import _single_thread
from hf_cases import build, inputs, my_rows
from peft_meta_cases import (SEED, STEPS, _adamw, _train, adapters,  # the LoRA flow's loop and optimizer
                             peaks_of_build_load_step)

import peft  # noqa: E402
import transformers  # noqa: E402

KINDS = ("nf4", "nf4-double", "int8")


def quantization(kind: str) -> transformers.BitsAndBytesConfig:
    if kind.startswith("int8"):
        return transformers.BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=kind == "int8-fp16-weights")
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=kind == "nf4-double",
                                           bnb_4bit_compute_dtype=torch.float32)


def lora_config() -> "peft.LoraConfig":
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def meta_quantized_peft(kind: str, checkpointing: Optional[str] = None, **overrides):
    """The same QLoRA model declared on the meta device: nothing is read or quantized yet."""
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    with torch.device("meta"):
        base = replace_with_bnb_linear(build("llama", device="meta", **overrides), modules_to_not_convert=["lm_head"],
                                       quantization_config=quantization(kind))
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    net = peft.get_peft_model(base, lora_config())
    net.train()
    return net


def quantized_peft(folder: str, kind: str, checkpointing: Optional[str] = None):
    """bitsandbytes QLoRA as users build it: the base quantized by from_pretrained, LoRA on top."""
    # dtype fp32: without it transformers loads a bitsandbytes base's other tensors in fp16
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization(kind),
                                                             device_map="cpu", dtype=torch.float32)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    torch.manual_seed(SEED)
    net = peft.get_peft_model(base, lora_config())
    net.train()
    return net


def reference(folder: str, kind: str, checkpointing: Optional[str] = None) -> dict:
    """One process, the whole global batch."""
    _single_thread()
    net = quantized_peft(folder, kind, checkpointing)
    initial = adapters(net.state_dict())
    losses = _train(net, _adamw(net), STEPS, slice(None))
    return {"initial": initial, "final": adapters(net.state_dict()), "losses": losses}


# --------------------------------------------------------------------------- workers


def train_loaded(folder: str, kind: str, checkpointing: Optional[str] = None, stage: int = 3) -> dict:
    """Every rank quantizes the base with from_pretrained, then ``stage`` shards it (and its adapters)."""
    _single_thread()
    net = quantized_peft(folder, kind, checkpointing)
    whole = sum(p.numel() * p.element_size() for p in net.parameters() if not p.requires_grad)
    model, optimizer = se.shard(net, _adamw(net), stage=stage)
    held = model.memory_report().params
    losses = _train(model, optimizer, STEPS, my_rows())
    return {"final": adapters(model.full_state_dict()), "losses": losses, "held": held, "whole": whole}


def train_on_meta_base(folder: str, kind: str, checkpointing: Optional[str] = None,
                       float_folder: Optional[str] = None) -> dict:
    """The base declared quantized on meta, stage 3, streamed in and quantized by se.load_pretrained
    (or, from a pre-quantized ``folder``, read as stored); its codes and state are compared with
    ``from_pretrained`` of ``folder`` and, given ``float_folder``, of that float checkpoint."""
    _single_thread()
    net = meta_quantized_peft(kind, checkpointing)
    torch.manual_seed(SEED)
    model, optimizer = se.shard(net, _adamw(net), stage=3)
    read = se.load_pretrained(model, folder).bytes_read
    unmapped = not _files_still_mapped(folder)
    initial = adapters(model.full_state_dict())
    loaded = quantized_peft(folder, kind)
    others = [loaded] + ([quantized_peft(float_folder, kind)] if float_folder else [])
    with model.summon_full_params():
        codes_equal = all(torch.equal(mine.data, theirs.data) and _states_equal(mine, theirs) for other in others
                          for mine, theirs in zip(_quantized_weights(net), _quantized_weights(other)))
    inference = _inference_equal(model, loaded) if kind == "int8" else None
    losses = _train(model, optimizer, STEPS, my_rows())
    return {"initial": initial, "final": adapters(model.full_state_dict()), "losses": losses,
            "codes_equal": codes_equal, "quantized": len(_quantized_weights(net)), "inference": inference,
            "bytes_read": read, "files_unmapped": unmapped}


def _inference_equal(model, reference) -> list[bool]:
    """Logits in eval mode under no_grad (bitsandbytes' int8 matmul with outlier decomposition)
    equal one process's on the same rows, at the default threshold 6.0 and at 0.02, where
    this model's activations have outlier columns."""
    batch = inputs("llama", 0, my_rows(), reference.config.vocab_size)
    states = [m.state for net in (model, reference) for m in net.modules() if hasattr(m, "state")
              and hasattr(m.state, "threshold")]
    default = states[0].threshold
    equal = []
    for threshold in (default, 0.02):
        logits = []
        for net in (model, reference):
            for state in states:
                state.threshold = threshold
            net.eval()
            with torch.no_grad():
                logits.append(net(**batch).logits)
            net.train()
        equal.append(torch.equal(*logits))
    for state in states:
        state.threshold = default
    return equal


def _quantized_weights(net) -> list[torch.Tensor]:
    from shardengine.flat.quantized import is_quantized_weight
    return [p for p in net.parameters() if is_quantized_weight(p)]


def _states_equal(mine, theirs) -> bool:
    """The quantization states: int8 scales, or every tensor and setting of a 4-bit state."""
    if getattr(theirs, "quant_state", None) is None:
        return torch.equal(mine.SCB, theirs.SCB)
    ours, want = mine.quant_state.as_dict(packed=True), theirs.quant_state.as_dict(packed=True)
    return ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)


def _files_still_mapped(folder: str) -> bool:
    """Whether a file of ``folder`` is still memory-mapped by this process (Linux): a tensor kept
    from a safetensors read views its map and keeps every page read from it resident."""
    with open("/proc/self/maps") as maps:
        return any(os.path.realpath(folder) in line for line in maps)


def save_quantized(folder: str, kind: str, out: str) -> None:
    """A pre-quantized folder: bitsandbytes' ``save_pretrained`` of the base quantized by ``from_pretrained``."""
    transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization(kind), device_map="cpu",
                                                      dtype=torch.float32).save_pretrained(out)


def stored_bytes(folder: str) -> tuple[int, int]:
    """Bytes of every tensor in a pre-quantized folder, and of the quantization states among them."""
    from safetensors import safe_open
    total = state = 0
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            total += tensor.numel() * tensor.element_size()
            state += 0 if name.endswith(".weight") else tensor.numel() * tensor.element_size()
    return total, state


def load_error(folder: str, kind: Optional[str]) -> str:
    """The error of loading ``folder`` into the base declared ``kind`` on meta (None: in float), or ""."""
    _single_thread()
    if kind is None:
        with torch.device("meta"):
            net = peft.get_peft_model(build("llama", device="meta"), lora_config())
    else:
        net = meta_quantized_peft(kind)
    model, _ = se.shard(net, _adamw(net), stage=3)
    try:
        se.load_pretrained(model, folder)
    except se.errors.CheckpointError as error:
        return str(error)
    return ""


def without_scales(folder: str, out: str) -> None:
    """A copy of a pre-quantized int8 folder whose row scales (``*.SCB``) are gone."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, out)
    tensors = {k: v for k, v in load_file(f"{folder}/model.safetensors").items() if not k.endswith(".SCB")}
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})


def int8_forward_before_load() -> str:
    """An int8 base on meta, sharded but not loaded: a forward is refused, not run on zero codes."""
    _single_thread()
    net = meta_quantized_peft("int8")
    model, _ = se.shard(net, _adamw(net), stage=3)
    try:
        model(**inputs("llama", 0, my_rows(), net.config.vocab_size))
    except se.ConfigError as error:
        return str(error)
    return ""


def int8_with_fp16_weights() -> str:
    _single_thread()
    net = meta_quantized_peft("int8-fp16-weights")
    try:
        se.shard(net, _adamw(net), stage=3)
    except se.ConfigError as error:
        return str(error)
    return ""


def host_peak_of_meta_flow(folder: str, overrides: dict, kind: str = "nf4-double") -> dict:
    """In a fresh process: resident bytes before building, the high-water mark after shard(),
    after load_pretrained and after the first step; the shard's and units' sizes to bound them."""
    _single_thread()
    net = meta_quantized_peft(kind, "non_reentrant", **overrides)
    layers = net.base_model.model.model.layers
    checkpoint_unit = max(sum(_source_bytes(p) for p in layer.parameters()) for layer in layers)
    peaks = peaks_of_build_load_step(net, folder)
    stored = sum(p.numel() * p.element_size() for p in net.parameters() if not p.requires_grad)
    checkpoint = sum(_source_bytes(p) for p in net.parameters() if not p.requires_grad)
    return {**peaks, "stored_bytes": stored, "checkpoint_bytes": checkpoint, "checkpoint_unit": checkpoint_unit}


def _source_bytes(param) -> int:
    """A parameter's bytes as the checkpoint holds it (a quantized weight: its original shape and dtype)."""
    from shardengine.flat.quantized import source_of
    shape, dtype = source_of(param) or (param.shape, param.dtype)
    return shape.numel() * dtype.itemsize
