"""``--emit``: the planner's fastest run written as the engine's own configuration.

- ``shardengine``: the ``se.shard(...)`` call (stage, ``shard_group_size``,
  ``offload_optimizer``, ``offload_params`` (a fraction, or ``"disk"``) or ``offload_device_budget``,
  ``param_dtype``) plus the loop's micro-batch, accumulation
  and checkpointing;
- ``deepspeed``: a ds_config dict (``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``, ``bf16``/``fp16``, ``zero_optimization.stage``,
  ``offload_optimizer``; hybrid stage 3 as MiCS' ``mics_shard_size``);
- ``fsdp2``: the ``fully_shard`` arguments (a 2-D mesh for hybrid sharding,
  ``reshard_after_forward``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``). FSDP2 has
  no optimizer-only sharding, so stage 1 is written as stage 2 and said so.

>>> from memory_estimator.plan.fastest import PlannedRun
>>> run = PlannedRun("zero3-hsdp8", 3, False, 8, "full", 2, 4, 1.0, 1e4, 2**35)
>>> emit_config("deepspeed", run, None, precision="bf16")["zero_optimization"]
{'stage': 3, 'mics_shard_size': 8}
"""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from ..errors import EstimatorInputError
from ..plan.fastest import PlannedRun
from ..terms.model_states import PARTIAL_PREFIX, PLAN_NAMES, PlanSpec, plan_spec

EMITTERS = ("shardengine", "deepspeed", "fsdp2")


def _precision(result, precision: Optional[str]) -> str:
    return precision or (result.setup.precision if result is not None else "bf16")


def emit_config(kind: str, planned: Optional[PlannedRun], result, precision: Optional[str] = None
                ) -> Union[str, dict]:
    if planned is None:
        raise EstimatorInputError("--emit writes the planner's choice: add --objective fastest (and a plan must fit)")
    if kind not in EMITTERS:
        raise EstimatorInputError(f"unknown --emit {kind!r}; choose from {', '.join(EMITTERS)}")
    name = _precision(result, precision)
    emitter = {"shardengine": _shardengine, "deepspeed": _deepspeed, "fsdp2": _fsdp2}[kind]
    return emitter(planned, name.removeprefix("pure-"), name.startswith("pure-"))


def _shardengine(run: PlannedRun, dtype: str, pure: bool = False) -> str:
    options = [f"stage={run.stage}"]
    if "-hsdp" in run.plan:
        options.append(f"shard_group_size={run.shard_group_size}")
    options += _parameters_on_host(run.plan) or (["offload_optimizer=True"] if run.offload else [])
    if dtype != "fp32" and not pure:
        options.append(f'param_dtype="{dtype}"')
    prefix = f"model = model.to(torch.{'bfloat16' if dtype == 'bf16' else 'float16'})  # pure {dtype}: no fp32 masters\n" \
        if pure else ""
    return (prefix + f"model, optimizer = se.shard(model, optimizer, {', '.join(options)})\n"
            f"# loop: micro-batch {run.micro_batch} per rank, {run.grad_accum} micro-steps per optimizer step "
            f"(model.no_sync() on all but the last); activation checkpointing: {run.checkpointing}")


def _parameters_on_host(plan: str) -> list[str]:
    """shard()'s options for the parameters off the device (all, a fraction or a budget's share
    on the host; or the disk tier's plans)."""
    spec = _shardengine_only_spec(plan)
    if spec is None:
        return ["offload_params=True"] if plan == "zero3-offload-params" else []
    if spec.disk:  # the files need a directory on a drive: the user's to name
        tier = 'offload_params="disk"' if spec.offload_params else 'offload_optimizer="disk"'
        return [tier, 'offload_path="/a/directory/on/a/drive"']
    if spec.params_fraction is not None:
        return [f"offload_params={spec.params_fraction:g}"]
    return [f"offload_device_budget={spec.device_budget}"]


def _shardengine_only_spec(plan: str) -> Optional[PlanSpec]:
    """The spec of a plan only shardengine runs (a fraction or budget, or the disk tier); None else.
    Plan names are checked before the fractional prefix: ``zero3-offload-params-disk`` has it."""
    if plan in PLAN_NAMES:
        spec = plan_spec(plan)
        return spec if spec.disk else None
    return plan_spec(plan) if plan.startswith(PARTIAL_PREFIX) else None


def _only_shardengine(run: PlannedRun, kind: str) -> None:
    spec = _shardengine_only_spec(run.plan)
    if spec is not None:
        what = "the disk tier" if spec.disk else "a fraction of the parameters on the host"
        raise EstimatorInputError(f"{run.plan} ({what}) is shardengine's plan; {kind} has no such "
                                  f"offload: use --emit shardengine")


def _deepspeed(run: PlannedRun, dtype: str, pure: bool = False) -> dict[str, Any]:
    _only_shardengine(run, "DeepSpeed")
    zero: dict[str, Any] = {"stage": run.stage}
    if run.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if "-hsdp" in run.plan and run.stage == 3:
        zero["mics_shard_size"] = run.shard_group_size
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": run.micro_batch,
                              "gradient_accumulation_steps": run.grad_accum, "zero_optimization": zero}
    if dtype in ("bf16", "fp16"):
        config[dtype] = {"enabled": True}
    return config


def _fsdp2(run: PlannedRun, dtype: str, pure: bool = False) -> str:
    # pure 16-bit: the model itself is 16-bit, no MixedPrecisionPolicy (its shards are the weights)
    torch_dtype = None if pure else {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(dtype)
    _only_shardengine(run, "FSDP2")
    lines = []
    if run.stage == 0:
        return (f"model = DistributedDataParallel(model)  # micro-batch {run.micro_batch}, accumulation "
                f"{run.grad_accum} (no_sync), checkpointing {run.checkpointing}")
    if "-hsdp" in run.plan:
        lines.append(f'mesh = init_device_mesh("cuda", (world_size // {run.shard_group_size}, '
                     f'{run.shard_group_size}), mesh_dim_names=("replicate", "shard"))')
    else:
        lines.append('mesh = init_device_mesh("cuda", (world_size,))')
    args = ["mesh=mesh", f"reshard_after_forward={run.stage == 3}"]
    if torch_dtype:
        args.append(f"mp_policy=MixedPrecisionPolicy(param_dtype={torch_dtype}, reduce_dtype=torch.float32)")
    if run.offload:
        args.append("offload_policy=CPUOffloadPolicy()")
    lines.append(f"for block in model.layers: fully_shard(block, {', '.join(args)})")
    lines.append(f"fully_shard(model, {', '.join(args)})")
    note = " (FSDP2 has no optimizer-only sharding: stage 1 runs as stage 2)" if run.stage == 1 else ""
    lines.append(f"# micro-batch {run.micro_batch}, accumulation {run.grad_accum}, checkpointing "
                 f"{run.checkpointing}{note}")
    return "\n".join(lines)


def format_planned(planned: Optional[PlannedRun], kind: Optional[str], emitted) -> str:
    if planned is None:
        return ""
    text = f"\nplanner (checkpointing, micro-batch x accumulation and plans searched): {planned.text()}"
    if kind:
        body = json.dumps(emitted, indent=2) if isinstance(emitted, dict) else emitted
        text += f"\n--emit {kind}:\n{body}"
    return text


def planner_json(payload: dict, planned: Optional[PlannedRun], kind: Optional[str], emitted) -> dict:
    if planned is None:
        return payload
    out = {**payload, "planned": planned.to_json_dict()}
    if kind:
        out["emit"] = {"kind": kind, "config": emitted}
    return out
