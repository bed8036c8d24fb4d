"""LoRA on a meta-device base, streamed in with ``se.load_pretrained``: rank workers.

Each worker builds a tiny Llama on the meta device, wraps it with
``peft.get_peft_model``, seeds the generator, shards it at stage 3, loads the
base from a folder ``hf_cases.make_pretrained`` wrote, and trains on its rows
of the global batch. The reference (in the test process, ``reference``) is
the same PEFT model over the base loaded with ``from_pretrained``, the
generator seeded the same way before ``get_peft_model``, trained on the whole
global batch: see [Note: the adapters' values on a meta base] in
``shardengine/flat/adapter_init.py`` for why the adapters start equal.
"""

from __future__ import annotations

from typing import Optional

import torch

import shardengine as se
from engine_cases import _single_thread
from hf_cases import build, inputs, load, my_rows
from shardengine.testing.host_memory import peak_rss_bytes, reset_peak_rss, rss_bytes

import peft  # noqa: E402

STEPS, SEED, LR = 4, 11, 1e-2
# The adapters' bound against one process (the LoRA and QLoRA tests' [Note]s say why).
ADAPTER_TOLERANCE = 2e-4
MiB = 1 << 20
# What a rank may hold beyond its shard and two units while building, loading and taking the
# first step of the host-peak cases (LoRA, and QLoRA counting the base as the checkpoint holds
# it): the allocator's and Python's working memory, the checkpoint pieces in flight, the
# activations and the adapters' state. Measured at N = 3: building and loading 15-16 MiB over
# the shard (one unit initialized or read at a time), the first step 33-34 MiB over the shard
# and two units.
FIXED_OVERHEAD = 48 * MiB
# The host-peak cases' Llama: 16 layers of 12.6 MB (202 MB fp32), so the whole base exceeds a
# rank's bound at N = 3.
HOST_PEAK_SIZE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=16, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64, vocab_size=64)
HOST_PEAK_WORLD = 3


def lora_config(init=True, **overrides) -> "peft.LoraConfig":
    options = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                   init_lora_weights=init)
    options.update(overrides)
    return peft.LoraConfig(**options)


def _checkpointing(model, mode: Optional[str]) -> None:
    if mode:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})


def meta_peft(init=True, checkpointing: Optional[str] = None, **overrides):
    """A PEFT Llama whose base (and so its adapters) is on the meta device."""
    net = build("llama", device="meta", **overrides)
    _checkpointing(net, checkpointing)
    return peft.get_peft_model(net, lora_config(init))


def adapters(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if "lora_" in k}


def _train(model, optimizer, steps: int, rows: slice) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(**inputs("llama", step, rows)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def reference(folder: str, init=True, checkpointing: Optional[str] = None, steps: int = STEPS) -> dict:
    """One process: the base from ``from_pretrained``, peft seeded as the workers seed shard()."""
    base = load("llama", folder)
    _checkpointing(base, checkpointing)
    torch.manual_seed(SEED)
    model = peft.get_peft_model(base, lora_config(init))
    model.train()
    initial = adapters(model.state_dict())
    losses = _train(model, _adamw(model), steps, slice(None))
    return {"initial": initial, "final": adapters(model.state_dict()), "losses": losses}


# --------------------------------------------------------------------------- workers


def train_on_meta_base(folder: str, init=True, checkpointing: Optional[str] = None, steps: int = STEPS) -> dict:
    """Meta base + LoRA, shard at stage 3, stream the base in, train ``steps``."""
    _single_thread()
    net = meta_peft(init, checkpointing)
    net.train()
    torch.manual_seed(SEED)
    model, optimizer = se.shard(net, _adamw(net), stage=3)
    report = se.load_pretrained(model, folder)
    state = model.full_state_dict()
    initial = adapters(state)
    base_loaded = load("llama", folder).state_dict()
    base_keys = {k: k.removeprefix("base_model.model.").replace(".base_layer", "") for k in state if "lora_" not in k}
    base_equal = all(torch.equal(state[k], base_loaded[b]) for k, b in base_keys.items())
    losses = _train(model, optimizer, steps, my_rows())
    return {"initial": initial, "final": adapters(model.full_state_dict()), "losses": losses,
            "base_equal": base_equal, "base_tensors": len(base_keys), "report": report}


def meta_flow_equals_loaded_flow(folder: str, param_dtype: Optional[str], steps: int = 2) -> dict:
    """The meta-device flow against the sharded model whose base was loaded on every rank
    (the flow that existed before), both with ``param_dtype``: adapters after ``steps``."""
    _single_thread()
    results = {}
    for flow in ("meta", "loaded"):
        if flow == "meta":
            net = meta_peft(checkpointing="non_reentrant")
            torch.manual_seed(SEED)
        else:
            base = load("llama", folder)
            _checkpointing(base, "non_reentrant")
            torch.manual_seed(SEED)
            net = peft.get_peft_model(base, lora_config())
        net.train()
        model, optimizer = se.shard(net, _adamw(net), stage=3, param_dtype=param_dtype)
        if flow == "meta":
            se.load_pretrained(model, folder)
        initial = adapters(model.full_state_dict())
        losses = _train(model, optimizer, steps, my_rows())
        results[flow] = {"initial": initial, "final": adapters(model.full_state_dict()), "losses": losses}
    return results


def refused_inits() -> dict:
    """Inits peft accepts on a meta base that the engine cannot draw there: the error of each.
    (PiSSA and OLoRA already fail inside get_peft_model on a meta base.)"""
    _single_thread()
    outcome = {}
    for case, options in {"dora": dict(use_dora=True), "orthogonal": dict(init_lora_weights="orthogonal"),
                          "eva": dict(init_lora_weights="eva")}.items():
        net = peft.get_peft_model(build("llama", device="meta"), lora_config(**options))
        try:
            se.shard(net, _adamw(net), stage=3)
            outcome[case] = None
        except se.ConfigError as error:
            outcome[case] = str(error)
    return outcome


def host_peak_of_meta_flow(folder: str, overrides: dict) -> dict:
    """In a fresh process: resident bytes before building, and the high-water mark after
    shard(), after load_pretrained and after the first step (each a peak up to then)."""
    _single_thread()
    net = meta_peft(checkpointing="non_reentrant", **overrides)
    net.train()
    sizes = unit_bytes(net)
    return {**peaks_of_build_load_step(net, folder), "largest_unit": max(sizes), "model_bytes": sum(sizes)}


def peaks_of_build_load_step(net, folder: str) -> dict:
    """Resident bytes before shard(), and the high-water mark after shard() at stage 3, after
    se.load_pretrained(folder) and after one training step (each a peak up to then)."""
    baseline = rss_bytes()
    torch.manual_seed(SEED)
    model, optimizer = se.shard(net, _adamw(net), stage=3)
    built = peak_rss_bytes()
    se.load_pretrained(model, folder)
    loaded = peak_rss_bytes()
    model(**inputs("llama", 0, my_rows(), net.config.vocab_size)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"baseline": baseline, "built": built, "loaded": loaded, "stepped": peak_rss_bytes()}


def host_peaks_of_flows(folder: str, overrides: dict, flows: list[str]) -> dict[str, dict]:
    """Each flow's host peaks in turn, in one fresh process (``"lora"``: :func:`host_peak_of_meta_flow`;
    a quantized kind: ``qlora_cases.host_peak_of_meta_flow``). The high-water mark is reset before
    each, so a flow's peaks are its own, as in a process of its own."""
    peaks = {}
    for flow in flows:
        reset_peak_rss()
        if flow == "lora":
            peaks[flow] = host_peak_of_meta_flow(folder, overrides)
        else:
            import qlora_cases  # it builds on this module
            peaks[flow] = qlora_cases.host_peak_of_meta_flow(folder, overrides, flow)
    return peaks


def unit_bytes(net) -> list[int]:
    """Bytes of each stage-3 unit of a PEFT Llama: every decoder layer, and the rest (the root)."""
    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())
    layers = [size(layer) for layer in net.base_model.model.model.layers]
    return layers + [size(net) - sum(layers)]


def shard_trainer_meta_and_loaded(folder: str, out: str) -> dict:
    """ShardTrainer over a meta base with ``pretrained=folder``, and over the same base loaded with
    ``from_pretrained`` (its adapters drawn under the trainer's seed, as shard() draws them):
    the adapters after training, and the frozen base of the meta flow."""
    import hf_trainer_cases as trainer_cases
    from shardengine.integrations.transformers import ShardTrainer

    _single_thread()
    results = {}
    for flow in ("meta", "loaded"):
        args = trainer_cases.arguments(f"{out}/{flow}", max_steps=2)
        if flow == "meta":
            net = meta_peft(checkpointing="non_reentrant")
        else:
            base = load("llama", folder)
            _checkpointing(base, "non_reentrant")
            torch.manual_seed(args.seed)
            net = peft.get_peft_model(base, lora_config())
        data = trainer_cases.TokenData(trainer_cases.rows_for(args.max_steps, args.gradient_accumulation_steps))
        trainer = ShardTrainer(model=net, args=args, train_dataset=data, shard_config={"stage": 3},
                               pretrained=folder if flow == "meta" else None)
        trainer.train()
        state = trainer.sharded_model.full_state_dict()
        results[flow] = {"adapters": adapters(state), "base": {k: v for k, v in state.items() if "lora_" not in k}}
    return results
