"""Rank workers of the weight-stream tests (``test_weight_stream.py``).

[Note: the reference]
What a stream must deliver is ``full_state_dict()`` of the same sharded model, cast to the
stream's dtype (the trainer's own word for its full weights), and, merged, what peft's
``merge_and_unload()`` gives for a one-process peft model holding those values. Each case
trains a step first, so masters, compute copies and adapters all differ from their
initial values. The receiver is a plain module of the same architecture in the stream's
dtype, loaded in place (``ModuleReceiver``); the stream's extra memory is every block the
allocator handed out while the stream ran (``AllocatorTracker``, blocks born in the phase).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Optional

import torch

import shardengine as se
from engine_cases import _single_thread
from rank_pool import rank_world
from shardengine.rl.receivers.module import ModuleReceiver
from shardengine.testing.allocator_tracker import AllocatorTracker
from shardengine.testing.models import build_gpt, example_inputs

DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}
# A consumer's work on each bucket (an inference engine's load takes milliseconds): it also gives
# Gloo's worker threads time to drop their reference to a finished broadcast's tensors, whose
# free the profiler would otherwise not see (shardengine/testing/allocator_tracker.py's Note).
CONSUMER_S = 0.01


def _trained_gpt(stage: int, precision: Optional[str], **options: Any):
    net = build_gpt("tiny", vocab_size=128, n_embd=48)
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=stage,
                                param_dtype=precision, **options)
    rank, world = rank_world()
    idx, targets = example_inputs(2 * world, 16, vocab_size=128, seed=3)
    model(idx[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model


def streamed_into(model, target: torch.nn.Module, **stream_options: Any) -> dict[str, Any]:
    """Stream ``model`` into ``target`` in place under the allocator tracker; what it cost."""
    stream = model.stream_weights(**stream_options)
    receiver = ModuleReceiver(target)
    with AllocatorTracker() as tracker:
        with tracker.phase("stream"):
            for bucket in stream:
                receiver.load(bucket)
                time.sleep(CONSUMER_S)
    missing = receiver.finish() if stream.receives else None
    return {"peak": tracker.peak_in("stream", since="stream"), "bound": stream.bound_bytes, "cap": stream.cap,
            "buckets": len(stream.plans), "receives": stream.receives, "collective": stream.collective,
            "bytes": stream.stats.bytes, "nbytes": stream.nbytes, "missing": missing}


def _equal_to(target: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    got = target.state_dict()
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def stream_matches_full_state(configs: list[dict]) -> list[dict]:
    """For each config (stage, precision, dtype, receivers, overlap, cap_fraction): the receiver's
    weights against ``full_state_dict()`` cast, and the stream's peak against its bound."""
    _single_thread()
    rank, _ = rank_world()
    results = []
    for config in configs:
        model = _trained_gpt(config["stage"], config.get("precision"), **config.get("options", {}))
        dtype = DTYPES[config.get("dtype")]
        full = model.full_state_dict()
        want = {k: v.to(dtype or v.dtype) for k, v in full.items()}
        target = build_gpt("tiny", vocab_size=128, n_embd=48)
        target = target.to(dtype) if dtype is not None else target
        total = sum(v.numel() * v.element_size() for k, v in want.items() if k != "lm_head.weight")
        cap = int(total * config.get("cap_fraction", 0.3))
        found = streamed_into(model, target, dtype=dtype, bucket_bytes=cap, receivers=config.get("receivers", "all"),
                              overlap=config.get("overlap", True))
        found.update(config=config, rank=rank, equal=_equal_to(target, want) if found["receives"] else None,
                     unchanged=all(torch.equal(v, model.full_state_dict()[k]) for k, v in full.items()))
        results.append(found)
    return results


# --------------------------------------------------------------------------- LoRA


def lora_stream_matches_merge_and_unload(stage: int, dtypes: list[Optional[str]]) -> dict:
    """A peft LoRA Llama trained a step at ``stage``; the merged stream against peft's merge_and_unload()."""
    from hf_cases import inputs, my_rows
    from peft_cases import peft_model

    _single_thread()
    net = peft_model("llama")
    model, optimizer = se.shard(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2),
                                stage=stage)
    model(**inputs("llama", 0, my_rows(), 64)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    full = model.full_state_dict()
    reference = peft_model("llama")
    reference.load_state_dict(full)
    merged = reference.merge_and_unload().state_dict()
    results = {}
    for name in dtypes:
        dtype = DTYPES[name]
        want = {k: v.to(dtype or v.dtype) for k, v in merged.items()}
        target = copy.deepcopy(reference.get_base_model() if hasattr(reference, "get_base_model") else reference)
        target = target.to(dtype) if dtype is not None else target
        total = sum(v.numel() * v.element_size() for v in want.values())
        found = streamed_into(model, target, dtype=dtype, bucket_bytes=total // 3)
        found.update(equal=_equal_to(target, want), names_equal=sorted(target.state_dict()) == sorted(merged))
        results[name] = found
    after = model.full_state_dict()
    results["adapters_untouched"] = sorted(after) == sorted(full) and all(torch.equal(after[k], full[k]) for k in full)
    results["moved"] = max((full[k] - v).abs().max().item() for k, v in peft_model("llama").state_dict().items()
                           if "lora_B" in k)
    return results


# --------------------------------------------------------------------------- bitsandbytes


def nf4_stream_matches_dequantized(folder: str, with_lora: bool, kind: str = "nf4") -> dict:
    """An NF4 (or int8) Llama (from_pretrained, bitsandbytes) at stage 3, forward-only or QLoRA trained a step:
    the stream against bitsandbytes' own dequantization of a one-process model (plus peft's delta)."""
    import bitsandbytes.functional as bnb_functional
    from hf_cases import inputs, my_rows
    from qlora_cases import quantized_peft, quantization

    import transformers

    _single_thread()

    def load():
        if with_lora:
            return quantized_peft(folder, kind)
        net = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization(kind),
                                                                device_map="cpu", dtype=torch.float32)
        return net.requires_grad_(False)

    net = load()
    if with_lora:
        model, optimizer = se.shard(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2),
                                    stage=3)
        model(**inputs("llama", 0, my_rows(), 64)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    else:
        model, _ = se.shard(net, None, stage=3)
    reference = load()
    if with_lora:
        reference.load_state_dict({k: v for k, v in model.full_state_dict().items() if "lora_" in k}, strict=False)
    target = transformers.AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32)
    want = _dequantized_reference(reference, bnb_functional, list(target.state_dict()))
    found = streamed_into(model, target, dtype=None, bucket_bytes=sum(v.numel() * 4 for v in want.values()) // 3)
    found.update(equal=_equal_to(target, want), names=sorted(target.state_dict()) == sorted(want))
    return found


def _dequantized_reference(net, bnb_functional, keys: list[str]) -> dict[str, torch.Tensor]:
    """The float weights of a one-process bitsandbytes (peft) model: each quantized weight as
    bitsandbytes dequantizes it, plus each active LoRA adapter's delta as peft adds it to a 4-bit base."""
    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    deltas = {}
    for module in net.modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "lora_A"):
            deltas[id(module.get_base_layer().weight)] = [module.get_delta_weight(a) for a in module.active_adapters]
    out = {}
    for path, module in base.named_modules():
        layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        for name, param in list(layer.named_parameters(recurse=False)) + list(layer.named_buffers(recurse=False)):
            key = f"{path}.{name}" if path else name
            if type(param).__name__ == "Params4bit":
                value = bnb_functional.dequantize_4bit(param.data, param.quant_state)
                for delta in deltas.get(id(param), []):
                    value = value + delta
            elif type(param).__name__ == "Int8Params":
                scales = param.SCB if param.SCB is not None else layer.state.SCB  # as peft reads them
                value = bnb_functional.int8_vectorwise_dequant(param.data, scales)
            else:
                value = param.detach()
            out[key] = value
    return {k: out[k] for k in keys if k in out}


# --------------------------------------------------------------------------- inference engines' form


def named_weights_for_engines(stage: int, receivers) -> dict:
    """TRL's vLLM sync walk over a stage-``stage`` GPT (tied embeddings): each tied weight once, no
    buffers, values equal full_state_dict() cast to bf16, only on the receiving ranks."""
    from shardengine.integrations.transformers.rollout import named_weights

    _single_thread()
    rank, _ = rank_world()
    model = _trained_gpt(stage, None)
    full = model.full_state_dict()
    pairs = [(name, tensor.clone()) for name, tensor in named_weights(model, torch.bfloat16, 4096, receivers)]
    params = [name for name, _ in model.module.named_parameters()]  # tied once, as vLLM wants them
    return {"rank": rank, "names": [n for n, _ in pairs], "params": params,
            "equal": all(torch.equal(t, full[n].bfloat16()) for n, t in pairs)}


# --------------------------------------------------------------------------- a colocated sync


def colocated_sync_reports(stage: int) -> dict:
    """WeightSync into a bf16 copy of the policy on every rank, numerics at each sync, after a step
    and after a deliberately wrong write into the rollout (which the report must flag)."""
    from shardengine.rl import ModuleReceiver, WeightSync

    _single_thread()
    model = _trained_gpt(stage, None)
    rollout = build_gpt("tiny", vocab_size=128, n_embd=48).to(torch.bfloat16)
    probe = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    sync = WeightSync(model, ModuleReceiver(rollout), dtype="bf16", bucket_bytes=16 << 10, check_every=1, probe=probe)
    first = sync.sync()
    equal = all(torch.equal(rollout.state_dict()[k], v.bfloat16()) for k, v in model.full_state_dict().items())
    with torch.no_grad():
        rollout.blocks[0].mlp.fc.weight.mul_(1.5)  # a rollout that did not get the trainer's weights
    wrong = sync.check(torch.bfloat16)
    return {"first": first.numerics.explained_by_dtype, "first_mean": first.numerics.mean_abs, "equal": equal,
            "wrong": wrong.explained_by_dtype, "buckets": first.buckets, "text": str(first)}


def stream_on_rank0_only() -> dict:
    """Rank 0 streams a stage-3 model while rank 1 trains on: the announced call is caught on both."""
    _single_thread()
    rank, world = rank_world()
    net = build_gpt("tiny", vocab_size=128, n_embd=48)
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3, timeout_s=300.0)
    idx, targets = example_inputs(2, 16, vocab_size=128, seed=3)
    started = time.monotonic()
    try:
        if rank == 0:
            for _ in model.stream_weights(dtype="bf16", bucket_bytes=16 << 10):
                pass
        for _ in range(2):
            model(idx, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    except se.CollectiveError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def stream_left_early() -> bool:
    """Every rank leaves a stage-3 stream after two buckets, trains a step, then streams whole: right values."""
    _single_thread()
    model = _trained_gpt(3, "bf16")
    stream = model.stream_weights(dtype="bf16", bucket_bytes=8 << 10)
    for index, _ in enumerate(stream):
        if index == 1:
            break
    rank, world = rank_world()
    idx, targets = example_inputs(2 * world, 16, vocab_size=128, seed=4)
    model(idx[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]).backward()
    full = model.full_state_dict()
    got = {name: tensor.clone() for bucket in stream for name, tensor in bucket}
    return all(torch.equal(got[k], v.bfloat16()) for k, v in full.items())
