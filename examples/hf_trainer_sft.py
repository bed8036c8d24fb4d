#!/usr/bin/env python3
"""Supervised fine-tuning with the Hugging Face ``Trainer`` API on shardengine: ``ShardTrainer``.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/hf_trainer_sft.py
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/hf_trainer_sft.py \\
        --stage 3 --bf16 --resume auto
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/hf_trainer_sft.py --lora

A tiny Llama is built from its config (nothing is downloaded) and fine-tuned on prompt/response
pairs made from the example corpus: the loss counts response tokens only (prompt labels are
-100), sequences are padded. ``ShardTrainer`` takes the usual ``Trainer`` arguments; the only
change from a DDP/FSDP/DeepSpeed run is the class and ``shard_config``. Checkpoints every
``--save-steps`` (resumable with ``--resume auto``, i.e. ``trainer.train(resume_from_checkpoint=True)``),
evaluation, then ``save_model``: an ordinary folder ``from_pretrained`` loads (with ``--lora``,
the adapter only, which ``PeftModel.from_pretrained`` loads). Needs ``pip install -e ".[hf]"``.
"""
from __future__ import annotations

import argparse
import os
import random

import torch

import shardengine as se
from data.corpus import CharTokenizer, generate_corpus  # examples/data, next to this script

import transformers  # noqa: E402
from shardengine.integrations.transformers import ShardTrainer  # noqa: E402

PAD = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights, as with DDP (TrainingArguments.bf16)")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (PEFT) instead of the whole model")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--save-steps", type=int, default=15, help="steps between checkpoints")
    p.add_argument("--out", default="hf_trainer_sft_run", help="output_dir")
    p.add_argument("--resume", choices=["no", "auto"], default="no", help="auto: from the newest checkpoint")
    return p.parse_args(argv)


class PromptResponse(torch.utils.data.Dataset):
    """Each corpus sentence split into a prompt (its first words) and a response (the rest)."""

    def __init__(self, sentences: list[str], tokenizer: CharTokenizer, length: int):
        self.items = [self._encode(s, tokenizer, length) for s in sentences]

    @staticmethod
    def _encode(sentence: str, tokenizer: CharTokenizer, length: int) -> dict[str, torch.Tensor]:
        words = sentence.split(" ")
        prompt = "### " + " ".join(words[:3]) + " >>"
        response = " " + " ".join(words[3:])
        ids = tokenizer.encode(prompt + response)[:length] + 1     # id 0 is the padding
        labels = ids.clone()
        labels[:len(prompt)] = -100                                # learn the response only
        pad = length - len(ids)
        return {"input_ids": torch.cat([ids, torch.full((pad,), PAD)]),
                "attention_mask": torch.cat([torch.ones(len(ids), dtype=torch.long), torch.zeros(pad, dtype=torch.long)]),
                "labels": torch.cat([labels, torch.full((pad,), -100)])}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def build_model(vocab_size: int, lora: bool) -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                                      max_position_embeddings=256, bos_token_id=1, eos_token_id=1,
                                      pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    return model


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = generate_corpus(60_000)
    tokenizer = CharTokenizer(text + "#>")   # + the prompt markers
    sentences = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.split()) > 4]
    random.Random(0).shuffle(sentences)
    length = 96
    train = PromptResponse(sentences[:-64], tokenizer, length)
    evaluation = PromptResponse(sentences[-64:], tokenizer, length)

    training_args = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.micro_batch, per_device_eval_batch_size=16,
        gradient_accumulation_steps=args.accumulate, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10), max_steps=args.steps, max_grad_norm=1.0, bf16=args.bf16,
        logging_steps=5, eval_strategy="steps", eval_steps=args.save_steps, save_strategy="steps",
        save_steps=args.save_steps, report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    model = build_model(tokenizer.vocab_size + 1, args.lora)
    trainer = ShardTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                           shard_config={"stage": args.stage})   # was: Trainer(..., args with fsdp=/deepspeed=)
    trainer.train(resume_from_checkpoint=True if args.resume == "auto" else None)
    metrics = trainer.evaluate()
    final = os.path.join(args.out, "final")
    trainer.save_model(final)
    if se.distributed.is_main_process():
        print(f"stage {args.stage}, {trainer.args.world_size} ranks, {trainer.state.global_step} steps: "
              f"eval loss {metrics['eval_loss']:.4f}; saved {sorted(os.listdir(final))}")
        if args.lora:
            from peft import PeftModel
            reloaded = PeftModel.from_pretrained(build_model(tokenizer.vocab_size + 1, False), final)
        else:
            reloaded = transformers.LlamaForCausalLM.from_pretrained(final)
        batch = {k: torch.stack([evaluation[i][k] for i in range(16)]) for k in evaluation[0]}
        with torch.no_grad():
            loss = reloaded(**batch).loss.item()
        print(f"reloaded with from_pretrained: loss {loss:.4f} on 16 evaluation sequences")


if __name__ == "__main__":
    main()
