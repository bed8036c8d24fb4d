#!/usr/bin/env python3
"""Fine-tune a Hugging Face causal LM with ZeRO stage 3, from weights no rank ever holds whole.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/finetune_hf.py
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/finetune_hf.py \\
        --pretrained path/to/save_pretrained_folder --out finetuned/

1. builds the model from its config on the meta device (no memory),
2. ``se.shard(..., stage=3, param_dtype="bf16")`` materializes it unit by unit
   (initialized by the model's own ``_init_weights``),
3. ``se.load_pretrained`` streams the weights in: each rank reads only its slices,
4. trains on the example corpus with bf16 compute, fp32 masters and activation
   checkpointing (``gradient_checkpointing_enable()``),
5. ``se.save_pretrained`` writes a folder ``from_pretrained`` loads (fp32),
6. generates a few tokens with the sharded model.

Without ``--pretrained`` rank 0 first writes a tiny random Llama "pretrained"
folder, so nothing is downloaded. Needs ``pip install -e ".[hf]"``.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import shardengine as se
from data.corpus import CharTokenizer, generate_corpus, get_batch  # examples/data, next to this script

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained", default=None,
                   help="a save_pretrained folder of a causal LM; default: write a tiny random Llama one")
    p.add_argument("--workdir", default="finetune_hf_run", help="where the tiny pretrained model goes")
    p.add_argument("--out", default=None, help="where the fine-tuned folder goes (default WORKDIR/finetuned)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file written (e.g. 500MB)")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16",
                   help="bf16: bf16 compute with fp32 master weights and optimizer state")
    p.add_argument("--no-checkpointing", action="store_true", help="keep all activations")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    p.add_argument("--prompt", default="The old miller", help="text to continue at the end")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens to generate")
    return p.parse_args(argv)


def say(text: str) -> None:
    if se.distributed.is_main_process():
        print(text, flush=True)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def write_tiny_pretrained(folder: str, vocab_size: int) -> None:
    """Rank 0: a random 4-layer Llama saved as a pretrained checkpoint (a stand-in for a real one)."""
    if se.distributed.is_main_process() and not os.path.isfile(os.path.join(folder, "config.json")):
        config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                                          max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=0, tie_word_embeddings=True)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="200KB")
        say(f"wrote a tiny pretrained Llama to {folder} ({len(os.listdir(folder))} files)")
    barrier()


class Tokens:
    """The corpus as token ids: the checkpoint's own tokenizer when it has one, else characters."""

    def __init__(self, folder: str, text: str):
        has_tokenizer = any(os.path.isfile(os.path.join(folder, name))
                            for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        self.hf = transformers.AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
        self.chars = None if has_tokenizer else CharTokenizer(text)
        self.ids = self.encode(text)

    def encode(self, text: str) -> torch.Tensor:
        if self.hf is not None:
            return torch.tensor(self.hf(text)["input_ids"], dtype=torch.long)
        return self.chars.encode(text)

    def decode(self, ids: torch.Tensor) -> str:
        return self.hf.decode(ids) if self.hf is not None else self.chars.decode(ids)


def build_and_load(args: argparse.Namespace, folder: str):
    """Config -> model on meta -> sharded (materialized unit by unit) -> pretrained weights streamed in."""
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(config)
    if not args.no_checkpointing:  # transformers >= 5.23 renamed gradient_checkpointing_enable()
        enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
        enable()
    model, optimizer = se.shard(net, lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
                                stage=args.stage, param_dtype=None if args.precision == "fp32" else "bf16")
    report = se.load_pretrained(model, folder)
    total = sum(p.numel() for p in net.parameters())
    say(f"loaded {report.tensors} tensors ({total / 1e6:.2f} M parameters) from {folder} in "
        f"{report.seconds:.2f} s; rank 0 read {report.bytes_read / 2**20:.2f} MiB "
        f"({report.key_mapping})")
    return model, optimizer


def train(args: argparse.Namespace, model, optimizer, ids: torch.Tensor) -> None:
    generator = torch.Generator().manual_seed(1 + se.distributed.rank())
    model.train()
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, _ = get_batch(ids, args.micro_batch, args.seq_len, generator)
        loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.log_every == 0 or step == 1:
            say(f"step {step:4d}  loss {loss.item():.4f}  {(time.perf_counter() - started) / step:.2f} s/step")


@torch.no_grad()
def validation_loss(model, ids: torch.Tensor, args: argparse.Namespace) -> float:
    x, _ = get_batch(ids, args.micro_batch, args.seq_len, torch.Generator().manual_seed(12345))
    return model(input_ids=x, labels=x).loss.item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = se.init_distributed()
    say(f"finetune_hf: stage {args.stage}, {args.precision}, {info.world_size} rank(s) on {info.device}")
    text = generate_corpus()
    folder = args.pretrained or os.path.join(args.workdir, "pretrained")
    if args.pretrained is None:
        write_tiny_pretrained(folder, CharTokenizer(text).vocab_size)
    tokens = Tokens(folder, text)
    model, optimizer = build_and_load(args, folder)
    train(args, model, optimizer, tokens.ids)

    out = args.out or os.path.join(args.workdir, "finetuned")
    started = time.perf_counter()
    files = se.save_pretrained(model, out, max_shard_size=args.max_shard_size)
    say(f"saved {out}: {len(files)} files in {time.perf_counter() - started:.2f} s")
    model.eval()
    sharded_loss = validation_loss(model, tokens.ids, args)
    if se.distributed.is_main_process():  # the saved folder is an ordinary Hugging Face checkpoint
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        say(f"validation loss: sharded model ({args.precision} compute) {sharded_loss:.4f}, "
            f"from_pretrained({out}) (fp32) {validation_loss(reloaded, tokens.ids, args):.4f}")

    prompt = tokens.encode(args.prompt).unsqueeze(0)
    generated = model.module.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                      pad_token_id=model.module.config.pad_token_id)  # collective
    say(f"generated: {tokens.decode(generated[0])!r}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
