"""What ``ShardTrainer`` takes from ``TrainingArguments``, and the combinations it refuses.

``shard_config`` (a ``se.config.ShardConfig`` or a dict of ``se.shard`` options, ``stage``
included) is the engine's configuration; a few ``TrainingArguments`` fields
mean the same thing and fill what it leaves unset: ``fp16`` -> ``param_dtype``
(compute in fp16, fp32 masters and optimizer state, the engine's loss scale),
``ddp_bucket_cap_mb`` -> ``bucket_mb``, ``ddp_broadcast_buffers`` ->
``broadcast_buffers``.

[Note: bf16=True is autocast, as with DDP]
``TrainingArguments(bf16=True)`` (TRL's configs set it by default) means
accelerate's ``torch.autocast(bfloat16)`` over fp32 weights under DDP: matmuls
in bf16, norms, softmax, the loss and the residual stream in fp32. The
engine's ``param_dtype="bf16"`` computes everything in bf16 instead: on a
tiny Llama the first loss already differs in the 5th digit and the weights
drift ~1e-2 apart in 6 steps (TRL's SFT defaults). So ``bf16=True`` keeps accelerate's
autocast and the engine computes over its fp32 weights: the same numbers as
DDP. ``shard_config={"param_dtype": "bf16"}`` asks for the engine's bf16
compute copy (half the gathered bytes, ZeRO's memory figures); autocast is
then off. ``fp16=True`` still maps to the engine's ``param_dtype="fp16"``:
accelerate's GradScaler unscales ``param.grad``, which the engine's reduced,
sharded gradients are not.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional, Union

from shardengine.config import ConfigError, ShardConfig

ShardConfigArg = Union[ShardConfig, dict, None]

_SHARD_CALL_ONLY = ("micro_batch", "seq_len", "example_inputs", "memory_budget_bytes")


def shard_options(shard_config: ShardConfigArg, args: Any) -> dict[str, Any]:
    """``se.shard`` keyword arguments (``stage`` included) for these ``TrainingArguments``."""
    if isinstance(shard_config, ShardConfig):
        options = {f.name: getattr(shard_config, f.name) for f in fields(ShardConfig)}
        if shard_config.param_dtype is not None:
            options["param_dtype"] = shard_config.param_dtype
    elif isinstance(shard_config, dict) or shard_config is None:
        options = dict(shard_config or {})
    else:
        raise ConfigError(f"shard_config must be a shardengine.config.ShardConfig or a dict of se.shard options, "
                          f"got {type(shard_config).__name__}")
    implied = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    given = options.get("param_dtype")
    if implied is not None and given is not None and _dtype_name(given) != implied:
        raise ConfigError(f"TrainingArguments({implied}=True) asks for {implied} compute but shard_config "
                          f"has param_dtype={given!r}; set one of them")
    if implied == "fp16":
        options["param_dtype"] = implied
    if getattr(args, "ddp_bucket_cap_mb", None) is not None:
        options.setdefault("bucket_mb", args.ddp_bucket_cap_mb)
    if getattr(args, "ddp_broadcast_buffers", None) is not None:
        options.setdefault("broadcast_buffers", args.ddp_broadcast_buffers)
    options.setdefault("stage", 0)
    checked = {k: v for k, v in options.items() if k not in _SHARD_CALL_ONLY and k != "stage"}
    ShardConfig.from_kwargs(None, 1 if options["stage"] == "auto" else options["stage"], checked)
    return options


# The se.shard options a frozen reference model shares with the policy: how it is computed and
# communicated. The gradient and optimizer options have nothing to act on in a forward-only model.
_REFERENCE_OPTIONS = ("param_dtype", "timeout_s", "collectives", "bucket_mb", "shard_group_size")


def reference_options(options: dict[str, Any]) -> dict[str, Any]:
    """``se.shard`` keyword arguments for a trainer's frozen reference model (TRL's DPO ``ref_model``).

    [Note: the reference at stage 3]
    A reference only runs forwards, so stage 3 costs it no more traffic per step than a
    replicated copy costs memory: one all-gather per unit per forward, against the whole model
    on every rank. It is sharded at stage 3 whatever the policy's stage."""
    chosen = {k: v for k, v in options.items() if k in _REFERENCE_OPTIONS}
    return {**chosen, "stage": 3}


def keeps_autocast(shard_config: ShardConfigArg, args: Any) -> bool:
    """Whether accelerate's bf16 autocast stays on (``bf16=True`` and no engine ``param_dtype``; see the Note)."""
    if not getattr(args, "bf16", False):
        return False
    if isinstance(shard_config, ShardConfig):
        return shard_config.param_dtype is None
    return not (isinstance(shard_config, dict) and shard_config.get("param_dtype") is not None)


def check_arguments(args: Any, is_peft: bool) -> None:
    """Refuse ``TrainingArguments`` that ask for another engine, or for what ShardTrainer cannot do."""
    problems = []
    if getattr(args, "deepspeed", None):
        problems.append("deepspeed= is set: ShardTrainer replaces DeepSpeed ZeRO; remove deepspeed= and "
                        "give the stage in shard_config (ZeRO-2 -> {'stage': 2}, ZeRO-3 -> {'stage': 3})")
    if getattr(args, "fsdp", None):
        problems.append("fsdp= is set: ShardTrainer replaces FSDP; remove fsdp=/fsdp_config= and use "
                        "shard_config={'stage': 3} (full_shard) or {'stage': 2} (shard_grad_op)")
    if getattr(args, "torch_compile", False):
        problems.append("torch_compile=True is not supported by ShardTrainer yet (the engine's hooks are "
                        "untested under torch.compile); compile the model's blocks yourself or leave it off")
    if getattr(args, "parallelism_config", None) is not None:
        problems.append("parallelism_config= (tensor/context parallelism) cannot be combined with ShardTrainer")
    if getattr(args, "n_gpu", 0) > 1:
        problems.append(f"this process sees {args.n_gpu} GPUs and Trainer would use torch.nn.DataParallel; "
                        "launch one process per GPU with torchrun")
    if is_peft and getattr(args, "load_best_model_at_end", False):
        problems.append("load_best_model_at_end=True with a PEFT model is not supported by ShardTrainer: "
                        "reload the best checkpoint's adapter with PeftModel.from_pretrained after training")
    if problems:
        raise ValueError("ShardTrainer: " + "; ".join(problems))


def _dtype_name(value: Any) -> str:
    text = str(value).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(text, text)


def is_peft_model(model: Optional[Any]) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
