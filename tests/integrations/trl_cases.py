"""Rank workers of the TRL tests (``test_integration_trl.py``): ``SFTTrainer`` with DDP against
``shard_trainer_class(SFTTrainer)``.

[Note: the reference]
The reference is TRL's own ``SFTTrainer`` under DDP (accelerate wraps the model
in ``DistributedDataParallel`` on the pool's Gloo group), run in the same
worker on the same tiny Llama (built from the same seed), the same texts and
the same ``SFTConfig``. The texts have different lengths, so every batch is
padded and the per-rank token counts differ: what TRL normalizes by
(``num_items_in_batch`` over all ranks, times the world size) must meet what
the engine averages. ``SFTConfig`` turns ``bf16`` on by default, so both runs
are bf16 autocast runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rank_pool import rank_world

warnings.filterwarnings("ignore")
import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from engine_cases import rel_err  # noqa: E402
from hf_cases import build  # noqa: E402
from shardengine.integrations.transformers import shard_trainer_class  # noqa: E402

transformers.logging.set_verbosity_error()
LETTERS = "abcdefghijklmnopqrstuvwxyz "


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character (ids 3..29 within the tiny Llama's 64), pad 0, bos 1, eos 2."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(LETTERS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def texts(rows: int = 64, seed: int = 0) -> Dataset:
    """Random texts of 4 to 40 characters (longer ones are truncated to max_length)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 41, (rows,), generator=generator)
    return Dataset.from_dict({"text": ["".join(LETTERS[int(i)] for i in torch.randint(0, 27, (int(n),),
                                                                                     generator=generator))
                                       for n in lengths]})


def config(out: str, **overrides: Any) -> SFTConfig:
    values = dict(output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, max_length=32,
                  seed=0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                  dataloader_num_workers=0)
    values.update(overrides)
    return SFTConfig(**values)


def train(out: str, stage: Any, **overrides: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One run: ``stage=None`` is TRL's SFTTrainer with DDP, else the sharded trainer at that stage."""
    kwargs: dict[str, Any] = dict(model=build("llama"), args=config(out, **overrides), train_dataset=texts(),
                                  processing_class=tokenizer())
    if stage is None:
        trainer = SFTTrainer(**kwargs)
    else:
        trainer = shard_trainer_class(SFTTrainer)(**kwargs, shard_config={"stage": stage})
    trainer.train()
    # the logged loss (training_step's) and grad_norm (_get_grad_norm's), step by step
    losses = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
    if stage is None:
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, losses
    return trainer.sharded_model.full_state_dict(), losses


def sft_equals_ddp(out: str, stages: list[int], **overrides: Any) -> dict:
    """The DDP run once, then the sharded run at each stage: parameter errors and logged losses."""
    rank, _ = rank_world()
    want, want_losses = train(f"{out}/ddp", None, **overrides)
    initial = build("llama").state_dict()
    result: dict[str, Any] = {"ddp_losses": want_losses, "stages": {},
                              "moved": max(rel_err(want[k], initial[k]) for k in initial)}
    for stage in stages:
        got, losses = train(f"{out}/stage{stage}", stage, **overrides)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        result["stages"][stage] = {"error": max(rel_err(got[k], want[k]) for k in want), "losses": losses}
    return result if rank == 0 else {}


def preferences(rows: int = 16, seed: int = 1) -> Dataset:
    """Random prompts with a chosen and a rejected completion of different lengths."""
    generator = torch.Generator().manual_seed(seed)

    def text(low: int, high: int) -> str:
        n = int(torch.randint(low, high, (1,), generator=generator))
        return "".join(LETTERS[int(i)] for i in torch.randint(0, 27, (n,), generator=generator))
    rows_ = [(text(3, 10), text(2, 12), text(2, 12)) for _ in range(rows)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows_], "chosen": [r[1] for r in rows_],
                              "rejected": [r[2] for r in rows_]})


def train_dpo(out: str, stage: Any) -> dict[str, Any]:
    """TRL's DPOTrainer with a separate reference model: DDP (``stage=None``) or sharded at ``stage``."""
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=out, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3, max_length=32,
                     seed=0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                     dataloader_num_workers=0, bf16=False, beta=0.5)
    kwargs: dict[str, Any] = dict(model=build("llama"), ref_model=build("llama"), args=args,
                                  train_dataset=preferences(), processing_class=tokenizer())
    if stage is None:
        trainer = DPOTrainer(**kwargs)
    else:
        trainer = shard_trainer_class(DPOTrainer)(**kwargs, shard_config={"stage": stage})
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if stage is None:
        return {"params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, "losses": losses}
    reference = trainer.ref_model
    return {"params": trainer.sharded_model.full_state_dict(), "losses": losses,
            "reference_sharded": reference.memory_report().params,
            "reference_whole": sum(p.numel() * p.element_size() for p in build("llama").parameters()),
            "reference_after": reference.full_state_dict()}


def dpo_equals_ddp(out: str, stage: int) -> dict:
    """The DDP run, then the sharded one (policy at ``stage``, reference at stage 3)."""
    rank, _ = rank_world()
    want = train_dpo(f"{out}/ddp", None)
    got = train_dpo(f"{out}/stage{stage}", stage)
    initial = build("llama").state_dict()
    return {"error": max(rel_err(got["params"][k], want["params"][k]) for k in want["params"]),
            "moved": max(rel_err(want["params"][k], initial[k]) for k in initial),
            "losses": got["losses"], "ddp_losses": want["losses"],
            "reference_sharded": got["reference_sharded"], "reference_whole": got["reference_whole"],
            "reference_unchanged": all(torch.equal(got["reference_after"][k], initial[k]) for k in initial),
            "rank": rank}
