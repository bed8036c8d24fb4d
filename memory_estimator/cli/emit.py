"""``--emit``: the planner's fastest run written as the engine's own configuration.

- ``shardengine``: the ``se.shard(...)`` call (stage, ``shard_group_size``,
  ``reshard_after_forward=False`` when the estimate or the planner planned stage 3 so, ``offload_optimizer``,
  ``offload_params`` (a fraction, or ``"disk"``) or ``offload_device_budget``, ``param_dtype``,
  ``activation_checkpointing`` and ``activation_offload``) plus the loop's micro-batch and accumulation;
- ``deepspeed``: a ds_config dict (``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``, ``bf16``/``fp16``, ``zero_optimization.stage``,
  ``offload_optimizer`` and, for ``zero3-offload-params``, ``offload_param`` on the ``cpu``;
  the disk plans on ``nvme`` (ZeRO-Infinity, as engines/deepspeed.py models them) with a
  placeholder ``nvme_path``; hybrid stage 3 as MiCS' ``mics_shard_size``);
- ``fsdp2``: the ``fully_shard`` arguments (a 2-D mesh for hybrid sharding,
  ``reshard_after_forward``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` for
  ``zero3-offload-params``). FSDP2 has no optimizer-only sharding, so stage 1 is written as
  stage 2 and said so.

A plan the engine cannot run (a fraction of the parameters on the host; for FSDP2 the disk
tier and optimizer-only offload; for DeepSpeed hybrid stages 1-2) is refused with the reason;
:func:`emit_note` says what the user must still edit or know.

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
from ..terms.model_states import PlanSpec, plan_spec

EMITTERS = ("shardengine", "deepspeed", "fsdp2")
# The estimator takes no path for the disk tier: these placeholders are the user's to edit (emit_note says so)
SHARDENGINE_PATH = "/a/directory/on/a/drive"
NVME_PATH = "/local_nvme/edit-this-path"


def _precision(result, precision: Optional[str]) -> str:
    return precision or (result.setup.precision if result is not None else "bf16")


def emit_config(kind: str, planned: Optional[PlannedRun], result, precision: Optional[str] = None
                ) -> Union[str, dict]:
    if planned is None:
        raise EstimatorInputError("--emit writes the planner's choice: add --objective fastest (and a plan must fit)")
    if kind not in EMITTERS:
        raise EstimatorInputError(f"unknown --emit {kind!r}; choose from {', '.join(EMITTERS)}")
    name = _precision(result, precision)
    dtype, pure = name.removeprefix("pure-"), name.startswith("pure-")
    # stage 3 as the estimate planned it, or as the planner chose
    reshard = (result is None or result.setup.reshard_after_forward) and planned.reshard_after_forward
    if kind == "shardengine":
        return _shardengine(planned, dtype, pure, reshard)
    if kind == "fsdp2":
        return _fsdp2(planned, dtype, pure, reshard)
    return _deepspeed(planned, dtype, pure)


def _shardengine(run: PlannedRun, dtype: str, pure: bool = False, reshard_after_forward: bool = True) -> str:
    options = [f"stage={run.stage}"]
    if "-hsdp" in run.plan:
        options.append(f"shard_group_size={run.shard_group_size}")
    if run.stage == 3 and not reshard_after_forward:
        options.append("reshard_after_forward=False")
    options += _parameters_on_host(_spec(run)) or (["offload_optimizer=True"] if run.offload else [])
    if dtype != "fp32" and not pure:
        options.append(f'param_dtype="{dtype}"')
    if run.checkpointing != "none":
        options.append(f'activation_checkpointing="{run.checkpointing}"')
    if run.activation_offload:
        options.append("activation_offload=True")
    prefix = f"model = model.to(torch.{'bfloat16' if dtype == 'bf16' else 'float16'})  # pure {dtype}: no fp32 masters\n" \
        if pure else ""
    return (prefix + f"model, optimizer = se.shard(model, optimizer, {', '.join(options)})\n"
            f"# loop: micro-batch {run.micro_batch} per rank, {run.grad_accum} micro-steps per optimizer step "
            f"(model.no_sync() on all but the last)")


def _parameters_on_host(spec: PlanSpec) -> list[str]:
    """shard()'s options for the parameters off the device (all, a fraction or a budget's share
    on the host; or the disk tier's plans)."""
    if spec.disk:  # the files need a directory on a drive: the user's to name (emit_note)
        tier = 'offload_params="disk"' if spec.offload_params else 'offload_optimizer="disk"'
        return [tier, f'offload_path="{SHARDENGINE_PATH}"']
    if spec.params_fraction is not None:
        return [f"offload_params={spec.params_fraction:g}"]
    if spec.device_budget is not None:
        return [f"offload_device_budget={spec.device_budget}"]
    return ["offload_params=True"] if spec.offload_params else []


def _spec(run: PlannedRun) -> PlanSpec:
    """The plan's spec; a hybrid plan (``zero3-hsdp8``) is its stage's, sharded within groups."""
    return plan_spec(f"zero{run.stage}") if "-hsdp" in run.plan else plan_spec(run.plan)


def _cannot_run(run: PlannedRun, kind: str) -> Optional[str]:
    """Why the engine ``kind`` has no configuration for ``run``'s plan; None when it has one."""
    spec = _spec(run)
    if spec.partial_params:
        return ("keeps a fraction of the parameters on the host (shardengine's fractional offload); "
                + ("DeepSpeed's offload_param" if kind == "deepspeed" else "FSDP2's CPUOffloadPolicy")
                + " moves all of a rank's parameters or none")
    if kind == "deepspeed":
        if "-hsdp" in run.plan and run.stage < 3:
            return "shards within groups at stage 1-2; DeepSpeed does so only at stage 3 (MiCS' mics_shard_size)"
        return None
    if spec.disk:
        return "keeps offloaded state in files; FSDP2 has no disk tier (CPUOffloadPolicy moves it to host memory)"
    if spec.offload and not spec.offload_params:
        return ("offloads only the optimizer; FSDP2 has no such offload: its CPUOffloadPolicy moves the "
                "parameters and gradients too (the zero3-offload-params plan)")
    return None


def _refuse_unless_runnable(run: PlannedRun, kind: str) -> None:
    reason = _cannot_run(run, kind)
    if reason is not None:
        name = {"deepspeed": "DeepSpeed", "fsdp2": "FSDP2"}[kind]
        raise EstimatorInputError(f"--emit {kind}: {run.plan} {reason}. Use --emit shardengine, or plan "
                                  f"among the plans {name} runs with --engine {kind}")


def _offload_to(disk: bool) -> dict[str, Any]:
    """A ZeRO ``offload_optimizer`` / ``offload_param`` section: host memory, or ZeRO-Infinity's NVMe."""
    if disk:
        return {"device": "nvme", "nvme_path": NVME_PATH, "pin_memory": True}
    return {"device": "cpu", "pin_memory": True}


def _deepspeed(run: PlannedRun, dtype: str, pure: bool = False) -> dict[str, Any]:
    _refuse_unless_runnable(run, "deepspeed")
    spec = _spec(run)
    zero: dict[str, Any] = {"stage": run.stage}
    if spec.offload:
        zero["offload_optimizer"] = _offload_to(spec.disk)
    if spec.offload_params:  # stage 3: the 16-bit parameter partitions too (deepspeed.py models both)
        zero["offload_param"] = _offload_to(spec.disk)
    if "-hsdp" in run.plan:
        zero["mics_shard_size"] = run.shard_group_size
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": run.micro_batch,
                              "gradient_accumulation_steps": run.grad_accum, "zero_optimization": zero}
    if dtype in ("bf16", "fp16"):
        config[dtype] = {"enabled": True}
    return config


def _fsdp2(run: PlannedRun, dtype: str, pure: bool = False, reshard_after_forward: bool = True) -> str:
    # pure 16-bit: the model itself is 16-bit, no MixedPrecisionPolicy (its shards are the weights)
    torch_dtype = None if pure else {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(dtype)
    _refuse_unless_runnable(run, "fsdp2")
    lines = []
    if run.stage == 0:
        return (f"model = DistributedDataParallel(model)  # micro-batch {run.micro_batch}, accumulation "
                f"{run.grad_accum} (no_sync), checkpointing {run.checkpointing}")
    if "-hsdp" in run.plan:
        lines.append(f'mesh = init_device_mesh("cuda", (world_size // {run.shard_group_size}, '
                     f'{run.shard_group_size}), mesh_dim_names=("replicate", "shard"))')
    else:
        lines.append('mesh = init_device_mesh("cuda", (world_size,))')
    args = ["mesh=mesh", f"reshard_after_forward={run.stage == 3 and reshard_after_forward}"]
    if torch_dtype:
        args.append(f"mp_policy=MixedPrecisionPolicy(param_dtype={torch_dtype}, reduce_dtype=torch.float32)")
    if _spec(run).offload_params:  # parameters, gradients and the optimizer step on the host
        args.append("offload_policy=CPUOffloadPolicy(pin_memory=True)")
    lines.append(f"for block in model.layers: fully_shard(block, {', '.join(args)})")
    lines.append(f"fully_shard(model, {', '.join(args)})")
    note = " (FSDP2 has no optimizer-only sharding: stage 1 runs as stage 2)" if run.stage == 1 else ""
    lines.append(f"# micro-batch {run.micro_batch}, accumulation {run.grad_accum}, checkpointing "
                 f"{run.checkpointing}{note}")
    return "\n".join(lines)


def emit_note(kind: Optional[str], planned: Optional[PlannedRun], engine: Optional[str]) -> Optional[str]:
    """What the user must know about an emitted configuration: a placeholder path to edit, where
    DeepSpeed still keeps parameters in host memory, a plan priced with another engine's model."""
    if not kind or planned is None:
        return None
    spec, notes = _spec(planned), []
    if spec.disk:
        key = "offload_path" if kind == "shardengine" else "nvme_path"
        placeholder = SHARDENGINE_PATH if kind == "shardengine" else NVME_PATH
        notes.append(f"edit {key} (now {placeholder!r}): a directory on a fast local drive of every node, "
                     f"with room for the plan's disk bytes per rank (the estimator takes no path)")
    if spec.disk and spec.offload_params and kind == "deepspeed":
        notes.append("DeepSpeed keeps up to offload_param.max_in_cpu (default 1e9) parameter elements per rank "
                     "in host memory and swaps only the rest to nvme_path; lower it to move more")
    if engine is not None and engine != kind:
        notes.append(f"this plan was priced with {engine}'s memory model; --engine {kind} prices {kind}'s")
    return "; ".join(notes) or None


def format_planned(planned: Optional[PlannedRun], kind: Optional[str], emitted, note: Optional[str] = None) -> str:
    if planned is None:
        return ""
    text = f"\nplanner (checkpointing, micro-batch x accumulation and plans searched): {planned.text()}"
    if kind:
        body = json.dumps(emitted, indent=2) if isinstance(emitted, dict) else emitted
        text += f"\n--emit {kind}:\n{body}" + (f"\nnote: {note}" if note else "")
    return text


def planner_json(payload: dict, planned: Optional[PlannedRun], kind: Optional[str], emitted,
                 note: Optional[str] = None) -> dict:
    if planned is None:
        return payload
    out = {**payload, "planned": planned.to_json_dict()}
    if kind:
        out["emit"] = {"kind": kind, "config": emitted, **({"note": note} if note else {})}
    return out
