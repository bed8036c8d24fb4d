"""Rank workers of the GRPO tests (``test_integration_grpo.py``): TRL's ``GRPOTrainer`` with DDP against
``shard_trainer_class(GRPOTrainer)``, with and without a reference model.

[Note: the reference run]
TRL's own GRPOTrainer under DDP (accelerate wraps the policy in DistributedDataParallel on the pool's
Gloo group), in the same worker, on the same tiny Llama loaded from the same folder, the same prompts,
reward and GRPOConfig: each rank samples its completions with TRL's rank-seeded generator, so both
runs draw the same completions as long as they compute the same logits. With ``beta > 0`` TRL builds
its reference from the policy's folder; the sharded trainer shards it forward-only at stage 3 (as the
DPO reference), DDP keeps a whole one per rank.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rank_pool import rank_world

warnings.filterwarnings("ignore")
import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from engine_cases import rel_err  # noqa: E402
from hf_cases import build  # noqa: E402
from shardengine.integrations.transformers import shard_trainer_class  # noqa: E402
from trl_cases import LETTERS, tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()


def prompts(rows: int = 16, seed: int = 2) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"prompt": ["".join(LETTERS[int(i)] for i in torch.randint(0, 26, (4,), generator=generator))
                                         for _ in range(rows)]})


def reward_letters(completions: list[str], **_: Any) -> list[float]:
    """How many vowels a completion holds: a reward that separates the completions of a group."""
    return [float(sum(c in "aeiou" for c in text)) for text in completions]


def write_policy(folder: str) -> None:
    """The tiny Llama the runs start from, saved once (TRL builds its reference from this folder)."""
    build("llama", vocab_size=32, bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(folder)


def train_grpo(out: str, folder: str, stage: Any, beta: float) -> dict[str, Any]:
    """One run: ``stage=None`` is TRL's GRPOTrainer with DDP, else the sharded trainer at that stage."""
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                      max_steps=3, learning_rate=1e-2, beta=beta, seed=0, logging_steps=1, save_strategy="no",
                      report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
                      temperature=1.0)
    kwargs: dict[str, Any] = dict(model=transformers.AutoModelForCausalLM.from_pretrained(folder),
                                  reward_funcs=reward_letters, args=args, train_dataset=prompts(),
                                  processing_class=tokenizer())
    trainer = GRPOTrainer(**kwargs) if stage is None else \
        shard_trainer_class(GRPOTrainer)(**kwargs, shard_config={"stage": stage})
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    if stage is None:
        params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return {"params": params, "losses": losses, "rewards": rewards}
    found = {"params": trainer.sharded_model.full_state_dict(), "losses": losses, "rewards": rewards}
    if beta:
        reference = trainer.ref_model
        found["reference_sharded"] = reference.memory_report().params
        found["reference_whole"] = sum(p.numel() * p.element_size() for p in reference.module.parameters())
    return found


def grpo_equals_ddp(out: str, stages: list[int], beta: float) -> dict:
    """The DDP run once, then the sharded run at each stage: parameter errors, logged losses and rewards."""
    rank, _ = rank_world()
    folder = f"{out}/policy"
    if rank == 0:
        write_policy(folder)
    torch.distributed.barrier()
    want = train_grpo(f"{out}/ddp", folder, None, beta)
    initial = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    result: dict[str, Any] = {"ddp_losses": want["losses"], "ddp_rewards": want["rewards"], "stages": {},
                              "moved": max(rel_err(want["params"][k], initial[k]) for k in initial)}
    for stage in stages:
        got = train_grpo(f"{out}/stage{stage}", folder, stage, beta)
        assert sorted(got["params"]) == sorted(want["params"])
        got["error"] = max(rel_err(got["params"][k], want["params"][k]) for k in want["params"])
        del got["params"]
        result["stages"][stage] = got
    return result if rank == 0 else {}
