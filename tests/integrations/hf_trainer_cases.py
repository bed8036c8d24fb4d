"""Rank workers of the ShardTrainer tests (``test_integration_transformers.py``).

[Note: the reference]
The hand-written ``se.shard`` loop of the README runs in the same worker on
the same tiny Llama (built from its config with the same seed): the optimizer
Trainer would build (its class, hyperparameters and weight-decay groups), the
same linear warm-up schedule built over the optimizer ``shard()`` returned,
the very batches Trainer's dataloader yields on this rank (sequential
sampling), all but the last micro-batch of a window under ``no_sync``, each
loss divided by the accumulation count, ``model.clip_grad_norm_`` before the
step. Every sequence has the same length and no padding, so Trainer's
token-count normalization equals these per-micro-batch means.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional

import torch

import shardengine as se
from rank_pool import rank_world

warnings.filterwarnings("ignore", message=".*(bos|eos|pad)_token_id.*")
import transformers  # noqa: E402

from engine_cases import rel_err  # noqa: E402
from hf_cases import build  # noqa: E402
from shardengine.integrations.transformers import ShardTrainer  # noqa: E402

transformers.logging.set_verbosity_error()
SEQ, VOCAB, BATCH, LR = 8, 64, 2, 0.01


class TokenData(torch.utils.data.Dataset):
    """Fixed random token sequences (labels = inputs: causal LM)."""

    def __init__(self, rows: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (rows, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def arguments(out: str, **overrides: Any) -> transformers.TrainingArguments:
    values = dict(output_dir=out, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                  learning_rate=LR, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=1,
                  max_grad_norm=0.05, gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, train_sampling_strategy="sequential",
                  use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def rows_for(steps: int, accumulate: int) -> int:
    return steps * accumulate * BATCH * rank_world()[1]


def make_trainer(out: str, stage: int, data: Optional[TokenData] = None, model=None, shard: Optional[dict] = None,
                 **overrides: Any) -> ShardTrainer:
    args = arguments(out, **overrides)
    data = data if data is not None else TokenData(rows_for(args.max_steps, args.gradient_accumulation_steps))
    return ShardTrainer(model=model if model is not None else build("llama"), args=args, train_dataset=data,
                        eval_dataset=data, shard_config={"stage": stage, **(shard or {})})


def reference_loop(trainer: ShardTrainer, batches: list[dict], stage: int, shard: Optional[dict] = None
                   ) -> dict[str, torch.Tensor]:
    """The README's loop with what Trainer would use (see the Note)."""
    args = trainer.args
    net = build("llama")
    decay = set(trainer.get_decay_parameter_names(net))
    groups = [{"params": [p for n, p in net.named_parameters() if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in net.named_parameters() if n not in decay], "weight_decay": 0.0}]
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, net)
    model, optimizer = se.shard(net, cls(groups, **kwargs), stage=stage, **(shard or {}))
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=args.warmup_steps,
                                           num_training_steps=args.max_steps)
    accumulate = args.gradient_accumulation_steps
    model.train()
    for step in range(args.max_steps):
        window = batches[step * accumulate:(step + 1) * accumulate]
        for index, batch in enumerate(window):
            with (model.no_sync() if index < len(window) - 1 else _nothing()):
                (model(**batch).loss / accumulate).backward()
        model.clip_grad_norm_(args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model.full_state_dict()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return {key: rel_err(got[key], want[key]) for key in want}


# --------------------------------------------------------------------------- workers


def train_equals_loop(stage: int, out: str, shard: Optional[dict] = None) -> dict:
    """train() with accumulation and clipping, then evaluate(), predict() and save_model()."""
    trainer = make_trainer(out, stage, shard=shard)
    batches = [{k: v for k, v in b.items()} for b in trainer.get_train_dataloader()]
    result = trainer.train()
    state = trainer.sharded_model.full_state_dict()
    metrics = trainer.evaluate()
    predictions = trainer.predict(TokenData(2 * rank_world()[1], seed=3))
    trainer.save_model(os.path.join(out, "final"))
    want = reference_loop(trainer, batches, stage, shard)
    return {"errors": errors(state, want), "state": state if rank_world()[0] == 0 else {},
            "steps": result.global_step, "eval_loss": metrics["eval_loss"],
            "logits_shape": tuple(predictions.predictions.shape), "lr": trainer.optimizer.param_groups[0]["lr"]}


def save_resume(stage: int, resume_stage: int, out: str) -> dict:
    """4 steps saving every 2; then a fresh model and trainer resume from checkpoint-2 and finish."""
    data = TokenData(rows_for(4, 2))
    first = make_trainer(out, stage, data=data, max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    uninterrupted = first.sharded_model.full_state_dict()
    second = make_trainer(out, resume_stage, data=data, max_steps=4, save_strategy="no")
    second.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed = second.sharded_model.full_state_dict()
    return {"errors": errors(resumed, uninterrupted), "final": uninterrupted,
            "identical": all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted),
            "step": second.state.global_step, "files": sorted(os.listdir(os.path.join(out, "checkpoint-2")))}


def resume_at_other_world(checkpoint: str, out: str, saved_world: int = 2) -> dict:
    """Resume a checkpoint saved by save_resume at ``saved_world`` ranks on this world size, with the
    per-device batch scaled so that every step sees the same global batch."""
    _, world = rank_world()
    data = TokenData(4 * 2 * BATCH * saved_world)
    trainer = make_trainer(out, 2, data=data, max_steps=4, per_device_train_batch_size=BATCH * saved_world // world)
    trainer.train(resume_from_checkpoint=checkpoint)
    return {"state": trainer.sharded_model.full_state_dict(), "step": trainer.state.global_step}


def peft_adapter_only(stage: int, out: str) -> dict:
    """A LoRA model through ShardTrainer: save_model writes the adapter only, and it loads back."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False))
    trainer = make_trainer(out, stage, model=model, max_steps=2)
    trainer.train()
    trained = {k: v for k, v in trainer.sharded_model.full_state_dict().items() if "lora_" in k}
    folder = os.path.join(out, "adapter")
    trainer.save_model(folder)
    result = {"files": sorted(os.listdir(folder)) if rank_world()[0] == 0 else []}
    if rank_world()[0] == 0:
        reloaded = PeftModel.from_pretrained(build("llama"), folder)
        loaded = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
        result["errors"] = errors(loaded, trained)
        result["moved"] = max(rel_err(v, model_state) for v, model_state in
                              zip(trained.values(), _initial_lora().values()))
    return result


def _initial_lora() -> dict[str, torch.Tensor]:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False))
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def bad_combinations(out: str) -> dict[str, str]:
    """Each unsupported combination's error message."""
    found = {}

    def attempt(name, fn):
        try:
            fn()
            found[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the message is the test's subject
            found[name] = f"{type(error).__name__}: {error}"

    def with_field(name, value):
        args = arguments(out)
        object.__setattr__(args, name, value)  # as if set on the command line; checked by ShardTrainer
        return ShardTrainer(model=build("llama"), args=args, train_dataset=TokenData(8))

    attempt("deepspeed", lambda: with_field("deepspeed", {"zero_optimization": {"stage": 3}}))
    attempt("fsdp", lambda: with_field("fsdp", "full_shard"))
    attempt("torch_compile", lambda: with_field("torch_compile", True))
    attempt("option", lambda: make_trainer(out, 2, shard={"bucket_size": 1}))
    attempt("stage", lambda: make_trainer(out, 7))
    attempt("dtype_conflict", lambda: make_trainer(out, 1, shard={"param_dtype": "fp16"}, bf16=True))
    attempt("shard_config_type", lambda: ShardTrainer(model=build("llama"), args=arguments(out),
                                                       train_dataset=TokenData(8), shard_config=3))
    attempt("adafactor", lambda: make_trainer(out, 2, optim="adafactor").train())
    return found
