#!/usr/bin/env python3
"""LoRA fine-tuning with PEFT at ZeRO stage 3: a frozen base, trainable adapters, peft's own files.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/finetune_lora.py
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/finetune_lora.py \\
        --pretrained path/to/save_pretrained_folder --out my_adapter/

1. builds the causal LM on the meta device (no memory) and wraps it with
   ``peft.get_peft_model`` (LoRA on the attention's q and v projections): only
   the adapters train,
2. ``se.shard(..., stage=3, param_dtype="bf16")``: the frozen base is sharded
   too and costs no gradient or optimizer state; bf16 compute, fp32 adapters;
   the adapters are drawn as peft draws them, then ``se.load_pretrained``
   streams the base in, each rank reading only its own slices
   (``--load-on-every-rank``: the older flow, ``from_pretrained`` on every rank
   before ``shard()``; stages 0-2 always load that way),
3. trains with activation checkpointing (``gradient_checkpointing_enable()``),
4. ``model.save_pretrained(out)`` writes what peft writes (the adapter only;
   only the adapter parameters are gathered),
5. rank 0 loads the adapter back with ``PeftModel.from_pretrained`` over a
   fresh base and generates; the sharded model generates too (collective).

Without ``--pretrained`` rank 0 first writes a tiny random Llama "pretrained"
folder (as examples/finetune_hf.py does), so nothing is downloaded.
Needs ``pip install -e ".[hf]"`` (transformers, safetensors, peft).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import shardengine as se
from data.corpus import CharTokenizer, generate_corpus, get_batch  # examples/data, next to this script
from finetune_hf import Tokens, barrier, say, write_tiny_pretrained  # the tiny "pretrained" Llama

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import peft  # noqa: E402
import transformers  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained", default=None,
                   help="a save_pretrained folder of a causal LM; default: write a tiny random Llama one")
    p.add_argument("--workdir", default="finetune_lora_run", help="where the tiny pretrained model goes")
    p.add_argument("--out", default=None, help="where the adapter goes (default WORKDIR/adapter)")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16",
                   help="bf16: bf16 compute with fp32 adapter masters and optimizer state")
    p.add_argument("--no-checkpointing", action="store_true", help="keep all activations")
    p.add_argument("--load-on-every-rank", action="store_true",
                   help="from_pretrained on every rank before shard() instead of a meta base streamed in")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--targets", default="q_proj,v_proj", help="modules LoRA adapts (comma separated)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    p.add_argument("--prompt", default="The old miller", help="text to continue at the end")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens to generate")
    return p.parse_args(argv)


def build(args: argparse.Namespace, folder: str):
    """LoRA adapters over the base, sharded; the base streamed in from its folder (stage 3), or
    loaded whole on every rank first."""
    on_meta = args.stage == 3 and not args.load_on_every_rank
    if on_meta:
        with torch.device("meta"):
            base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    else:
        base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    if not args.no_checkpointing:  # transformers >= 5.23 renamed gradient_checkpointing_enable()
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                             target_modules=args.targets.split(","), task_type="CAUSAL_LM")
    net = peft.get_peft_model(base, config)
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    total = sum(p.numel() for p in net.parameters())
    torch.manual_seed(0)  # the adapters' init (drawn at shard() on a meta base)
    model, optimizer = se.shard(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad],
                                                        lr=args.lr, weight_decay=0.0),
                                stage=args.stage, param_dtype=None if args.precision == "fp32" else "bf16")
    if on_meta:
        report = se.load_pretrained(model, folder)
        say(f"streamed the base in: {report.tensors} tensors, {report.bytes_read / 2**20:.1f} MiB read by "
            f"rank 0 in {report.seconds:.2f} s")
    say(f"LoRA r={args.lora_rank} on {args.targets}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.2f}%)")
    return model, optimizer


def train(args: argparse.Namespace, model, optimizer, ids: torch.Tensor) -> None:
    generator = torch.Generator().manual_seed(1 + se.distributed.rank())
    model.train()
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, _ = get_batch(ids, args.micro_batch, args.seq_len, generator)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.log_every == 0 or step == 1:
            say(f"step {step:4d}  loss {loss.item():.4f}  {(time.perf_counter() - started) / step:.2f} s/step")
    report = model.memory_report()
    say(f"rank 0 holds: params {report.params / 2**10:.1f} KiB, grads {report.grads / 2**10:.1f} KiB, "
        f"optimizer states {report.optimizer_states / 2**10:.1f} KiB (frozen parameters: none of the last two)")


@torch.no_grad()
def validation_loss(model, ids: torch.Tensor, args: argparse.Namespace) -> float:
    x, _ = get_batch(ids, args.micro_batch, args.seq_len, torch.Generator().manual_seed(12345))
    return model(input_ids=x, labels=x).loss.item()


def reload_and_generate(folder: str, out: str, tokens: Tokens, args: argparse.Namespace) -> None:
    """Rank 0: a fresh base plus the saved adapter, as anyone would load it."""
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reloaded = peft.PeftModel.from_pretrained(base, out).eval()
    say(f"reloaded the adapter from {out}: validation loss (fp32) {validation_loss(reloaded, tokens.ids, args):.4f}")
    prompt = tokens.encode(args.prompt).unsqueeze(0)
    generated = reloaded.generate(input_ids=prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                  pad_token_id=base.config.pad_token_id)
    say(f"generated (reloaded): {tokens.decode(generated[0])!r}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    info = se.init_distributed()
    say(f"finetune_lora: stage {args.stage}, {args.precision}, {info.world_size} rank(s) on {info.device}")
    text = generate_corpus()
    folder = args.pretrained or os.path.join(args.workdir, "pretrained")
    if args.pretrained is None:
        write_tiny_pretrained(folder, CharTokenizer(text).vocab_size)
    tokens = Tokens(folder, text)
    model, optimizer = build(args, folder)
    model.eval()
    before = validation_loss(model, tokens.ids, args)
    train(args, model, optimizer, tokens.ids)
    model.eval()
    say(f"validation loss: before {before:.4f}, after {validation_loss(model, tokens.ids, args):.4f} "
        f"({args.precision} compute)")

    out = args.out or os.path.join(args.workdir, "adapter")
    started = time.perf_counter()
    model.save_pretrained(out)  # collective: peft's adapter files, written by rank 0
    say(f"saved the adapter to {out}: {sorted(os.listdir(out))} in {time.perf_counter() - started:.2f} s")
    if se.distributed.is_main_process():
        reload_and_generate(folder, out, tokens, args)
    barrier()
    prompt = tokens.encode(args.prompt).unsqueeze(0)
    generated = model.module.generate(input_ids=prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                      pad_token_id=model.module.config.pad_token_id)  # collective
    say(f"generated (sharded): {tokens.decode(generated[0])!r}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
