"""``ShardTrainer``: ``transformers.Trainer`` with ``se.shard`` in place of DDP / FSDP / DeepSpeed.

The overrides, in the order a run meets them (``ShardTrainerMixin`` holds them,
so the same works for Trainer subclasses such as TRL's ``SFTTrainer``, see
:func:`shard_trainer_class`):

* ``__init__``: ``shard_config`` and the ``TrainingArguments`` it absorbs are
  checked (arguments.py); ``bf16=True`` keeps accelerate's autocast (DDP's
  numbers), otherwise autocast/GradScaler are off and the engine's
  ``param_dtype`` does mixed precision;
* ``_wrap_model``: Trainer has built its optimizer over the model (or was given
  one); both go through ``se.shard`` and the trainer steps the returned
  optimizer. A scheduler given with the optimizer is moved to it; the one
  Trainer creates is built after, over the right optimizer;
* ``training_step``: equal batch weights (DDP's 1/N average, which Trainer's
  loss normalization assumes); accumulation uses ``model.no_sync()`` through
  accelerate, as with DDP;
* ``_clip_grad_norm`` / ``_get_grad_norm``: the engine's global norm;
* ``save_model``, checkpoints, resume, best model: saving.py;
* a frozen reference model (TRL's ``DPOTrainer(ref_model=...)``, ``GRPOTrainer`` with ``beta > 0``)
  is sharded forward-only at stage 3 along with the policy: each rank holds its shard of it;
* TRL's vLLM mode (``GRPOTrainer(use_vllm=True)``) syncs through ``model.stream_weights`` under
  ``weight_sync_bytes`` (rollout.py).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import transformers

import shardengine as se
from shardengine.model import ShardedModel

from ..schedulers import retarget_schedulers
from . import saving
from .rollout import wire_vllm
from .arguments import ShardConfigArg, check_arguments, is_peft_model, keeps_autocast, reference_options, shard_options


class ShardTrainerMixin:
    """The overrides that make a ``transformers.Trainer`` (sub)class train through shardengine."""

    def __init__(self, *args: Any, shard_config: ShardConfigArg = None, pretrained: Optional[str] = None,
                 weight_sync_bytes: int = 256 << 20, **kwargs: Any) -> None:
        self._weight_sync_bytes = weight_sync_bytes  # TRL's vLLM mode: the stream's cap per rank (rollout.py)
        model = kwargs.get("model", args[0] if args else None)
        self._pretrained = pretrained  # streamed in with se.load_pretrained right after shard()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # fail before Trainer builds DeepSpeed/FSDP plugins
            check_arguments(training_args, is_peft_model(model))
        self._shard_config = shard_config
        self._sharded: Optional[ShardedModel] = None
        self._sharded_optimizer: Optional[torch.optim.Optimizer] = None
        super().__init__(*args, **kwargs)
        check_arguments(self.args, is_peft_model(self.model))
        self._shard_kwargs = shard_options(shard_config, self.args)

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The ``se.model.ShardedModel`` once training started (``summon_full_params()``, ``memory_report()``)."""
        return self._sharded

    # ------------------------------------------------------------------ precision

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        if not keeps_autocast(self._shard_config, self.args):
            built["mixed_precision"] = "no"  # the engine computes in param_dtype; no autocast, no GradScaler
        return built

    # ------------------------------------------------------------------ wrapping

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None):
        if self._sharded is not None:
            return self._sharded
        if not training:
            return model  # evaluation before training: every rank runs its own full copy, as DDP does
        self._shard()
        return self._sharded

    def _shard(self) -> None:
        if self.optimizer is None:
            self.create_optimizer()
        user_optimizer = self.optimizer
        model, optimizer = se.shard(self.model, user_optimizer, **self._shard_kwargs)
        if self._pretrained is not None:
            se.load_pretrained(model, self._pretrained)
        if self.accelerator.native_amp:
            # bf16=True without an engine param_dtype: autocast the sharded forward exactly as accelerate
            # autocasts DDP's (outputs back to fp32), without its device placement or DDP wrapping
            model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        retarget_schedulers([self.lr_scheduler], user_optimizer, optimizer)
        self._sharded, self._sharded_optimizer = model, optimizer
        self.optimizer = optimizer
        self._shard_reference()
        wire_vllm(self, model, self._weight_sync_bytes)

    def _shard_reference(self) -> None:
        """TRL's frozen reference (``DPOTrainer(ref_model=...)``): forward-only, at stage 3."""
        reference = getattr(self, "ref_model", None)
        if not isinstance(reference, torch.nn.Module) or isinstance(reference, ShardedModel):
            return  # none (PEFT's adapter-disabled policy serves as reference), or already sharded
        reference.requires_grad_(False)  # TRL keeps it in eval mode and never steps it; frozen makes that explicit
        self.ref_model, _ = se.shard(reference, None, **reference_options(self._shard_kwargs))

    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        if any(p.is_meta for p in model.parameters()):
            return  # a meta-device model is materialized by shard() (stage 3), on the engine's device
        super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ the step

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if isinstance(model, ShardedModel):
            # [Note: DDP's average] Trainer divides the loss for accumulation (or by the tokens of all
            # ranks, times the world size) expecting DDP's plain 1/N over ranks: equal weights give it.
            model.set_batch_weight(1.0)
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: torch.nn.Module):
        if isinstance(model, ShardedModel):
            return model.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None):
        if isinstance(model, ShardedModel) and grad_norm is None:
            return model.clip_grad_norm_(math.inf)  # the norm only: an infinite bound clips nothing
        return super()._get_grad_norm(model, grad_norm)

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """An ordinary Hugging Face folder (adapter only for a PEFT model); collective once sharded."""
        if self._sharded is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if is_peft_model(self.model):
            # the adapter is a small part of the model: PEFT picks its tensors out of the full state
            state = self._sharded.full_state_dict(rank0_only=True)
            self._save(output_dir, state_dict=state)
        else:
            saving.save_whole_model(self._sharded, output_dir)
            if self.args.should_save:
                saving.save_extras(self, output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._sharded is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        se.save_checkpoint(saving.engine_checkpoint(output_dir), self._sharded, self._sharded_optimizer,
                           extra={"step": int(self.state.global_step)}, keep=1)
        if self.args.should_save:
            saving.save_scheduler(self.lr_scheduler, output_dir)

    # ------------------------------------------------------------------ resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        if saving.has_engine_checkpoint(resume_from_checkpoint):
            return  # the engine's checkpoint restores the weights exactly, after shard()
        if self._sharded is not None:
            raise ValueError(f"{resume_from_checkpoint} has no shardengine/ checkpoint; this trainer's model is "
                             "already sharded, so resume it from a ShardTrainer checkpoint (or use a new trainer)")
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or self._sharded is None or not saving.has_engine_checkpoint(checkpoint):
            # a plain Trainer checkpoint: its optimizer.pt is torch's format, which the engine re-partitions
            return super()._load_optimizer_and_scheduler(checkpoint)
        se.load_checkpoint(saving.engine_checkpoint(checkpoint), self._sharded, self._sharded_optimizer)
        saving.load_scheduler(self.lr_scheduler, checkpoint)

    def _load_best_model(self) -> None:
        if self._sharded is None:
            return super()._load_best_model()
        se.load_pretrained(self._sharded, self.state.best_model_checkpoint)


class ShardTrainer(ShardTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` sharded by shardengine: ``ShardTrainer(model, args, shard_config={"stage": 3})``.

    Takes every ``Trainer`` argument, plus ``shard_config``: a ``se.config.ShardConfig`` or a
    dict of ``se.shard`` options with ``stage`` (default 0). ``TrainingArguments(bf16=True)``
    autocasts as under DDP (``shard_config={"param_dtype": "bf16"}`` for the engine's bf16
    compute copy); ``fp16=True`` becomes ``param_dtype="fp16"``; ``deepspeed=`` / ``fsdp=`` are refused.
    ``pretrained=folder`` streams a checkpoint in with ``se.load_pretrained`` right after sharding: a
    model built on the meta device (a PEFT model over a meta base included) at stage 3 is never whole
    on any rank.

    >>> trainer = ShardTrainer(model=model, args=TrainingArguments("out", bf16=True),  # doctest: +SKIP
    ...                        train_dataset=data, shard_config={"stage": 3})
    >>> trainer.train(); trainer.save_model("out/final")                               # doctest: +SKIP
    """


def shard_trainer_class(base: type) -> type:
    """A subclass of the Trainer subclass ``base`` with ShardTrainer's behaviour.

    >>> from trl import SFTTrainer                        # doctest: +SKIP
    >>> ShardSFTTrainer = shard_trainer_class(SFTTrainer)  # doctest: +SKIP
    """
    if not (isinstance(base, type) and issubclass(base, transformers.Trainer)):
        raise TypeError(f"shard_trainer_class needs a transformers.Trainer subclass, got {base!r}")
    return type(f"Shard{base.__name__}", (ShardTrainerMixin, base), {"__module__": base.__module__})
