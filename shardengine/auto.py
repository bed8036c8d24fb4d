"""``stage="auto"``: ask the memory estimator which plan fits, the same answer on every rank.

[Note: the one way from the engine to the estimator]
The estimator depends on the engine, never the reverse: it imports a small
pure API (flat.layout, flat.plan, distributed.traffic, the compression codecs'
byte sizes, step.agreement's vector size, policies, errors, data.proportions;
none imports torch.distributed) at module top, so its predictions use the
engine's own arithmetic. The engine reaches the estimator only here, in
:func:`_estimate_on_rank0`, imported when ``stage="auto"`` runs (the estimator
imports the engine, so a module-level import would be a cycle). Checked by
tests/architecture/test_package_boundaries.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import psutil
import torch
from torch import nn

from .distributed.communicator import Communicator
from .errors import ConfigError
from .config import ShardConfig

_PRECISION = {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# A 16-bit model sharded without param_dtype steps its own 16-bit weights: no fp32 master.
_PURE = {torch.bfloat16: "pure-bf16", torch.float16: "pure-fp16"}


def _precision(model: nn.Module, cfg: ShardConfig) -> str:
    if cfg.param_dtype is not None:
        return _PRECISION[cfg.param_dtype]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return _PURE.get(dtypes.pop(), "fp32") if len(dtypes) == 1 else "fp32"
# plan -> (stage, offload_optimizer, offload_params)
_PLAN_STAGES = {"ddp": (0, False, False), "zero1": (1, False, False), "zero2": (2, False, False),
                "zero3": (3, False, False), "zero3-offload": (3, True, False),
                "zero3-offload-params": (3, True, True)}


# the last resort; see [Note: stage="auto" offloads only the parameters it must] in
# memory_estimator/plan/device_budget.py
_ALL_ON_HOST = "zero3-offload-params"


@dataclass(frozen=True)
class AutoChoice:
    stage: int
    offload_optimizer: bool
    plan: str
    total_bytes: int
    device_bytes: int
    offload_params: bool = False
    device_budget: Optional[int] = None   # bytes of model states kept on the device (the rest on the host)


def _device_memory_bytes(model: nn.Module, comm: Communicator) -> int:
    """Memory this rank may use: free device memory (or its share of available RAM),
    plus what the model already occupies there; the smallest over all ranks."""
    held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    params = [p for p in model.parameters() if not p.is_meta]
    if params and params[0].is_cuda:
        free = torch.cuda.mem_get_info(params[0].device)[0]
    else:
        ranks_on_this_host = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        free = psutil.virtual_memory().available // ranks_on_this_host
    return min(comm.all_gather_object(free + held))


def _estimate_on_rank0(model, optimizer, comm, cfg: ShardConfig, micro_batch, seq_len,
                       example_inputs, memory_bytes: int) -> dict[str, Any]:
    """Rank 0 estimates; the others take its answer (estimates could differ by a byte of free RAM).
    An estimate that fails on rank 0 fails on every rank, with rank 0's error, instead of leaving
    the others waiting for an answer."""
    answer: dict[str, Any] = {}
    if comm.rank == 0:
        try:
            import memory_estimator as me

            answer = _estimate(me, model, optimizer, comm, cfg, micro_batch, seq_len,
                               example_inputs, memory_bytes)
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            answer = {"error": f"{type(error).__name__}: {error}"}
            comm.all_gather_object(answer)
            raise
    answer = comm.all_gather_object(answer)[0]
    if "error" in answer:
        raise ConfigError(f"stage='auto': the memory estimate failed on rank 0 ({answer['error']})")
    return answer


def _estimate(me, model, optimizer, comm, cfg: ShardConfig, micro_batch, seq_len,
              example_inputs, memory_bytes: int) -> dict[str, Any]:
    """The estimator's answer for this run (``me``: the estimator, imported by the caller)."""
    on_gpu = any(p.is_cuda for p in model.parameters())
    options = me.EngineOptions(
        bucket_mb=cfg.bucket_mb, wrap=cfg.wrap, wrap_min_params=cfg.wrap_min_params,
        prefetch=cfg.prefetch, max_inflight_buckets=cfg.max_inflight_buckets,
        reduce_precision=_PRECISION[cfg.reduce_dtype] if cfg.reduce_dtype else None,
        reduces_in_place=comm.reduces_in_place, shard_group_size=cfg.shard_group_size,
        reshard_after_forward=cfg.reshard_after_forward)
    result = me.estimate(me.EstimateRequest(
        model=me.ModelRequest(module=model, example_inputs=example_inputs),
        training=me.TrainingRequest(world_size=comm.world_size, precision=_precision(model, cfg),
                                    optimizer=optimizer, micro_batch=micro_batch, seq_len=seq_len),
        engine=me.EngineRequest(options=options),
        # CPU: no CUDA context or allocator overheads
        target=me.TargetRequest(device=None if on_gpu else "cpu", device_memory_bytes=memory_bytes)))
    answer = {"recommended": result.recommended, "suggestions": list(result.suggestions),
              "totals": {p.name: p.total for p in result.plans}}
    if result.recommended == _ALL_ON_HOST:
        partial = me.largest_device_budget(result)
        if partial is not None:
            budget, plan = partial
            answer["recommended"], answer["device_budget"] = plan.name, budget
            answer["totals"][plan.name] = plan.total
    return answer


def choose_plan(model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                cfg: ShardConfig, micro_batch: Optional[int], seq_len: Optional[int],
                example_inputs: Optional[Callable] = None,
                memory_budget_bytes: Optional[int] = None) -> AutoChoice:
    """The least-sharded plan the estimator says fits; a clear error when none does."""
    if micro_batch is None or seq_len is None:
        raise ConfigError("stage='auto' needs micro_batch= and seq_len= to estimate activations")
    memory = _device_memory_bytes(model, comm)
    if memory_budget_bytes is not None:
        if memory_budget_bytes <= 0:
            raise ConfigError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
        memory = min(memory, int(memory_budget_bytes))
    answer = _estimate_on_rank0(model, optimizer, comm, cfg, micro_batch, seq_len,
                                example_inputs, memory)
    if answer["recommended"] is None:
        tried = ", ".join(f"{name} {total / 2**30:.2f} GiB" for name, total in answer["totals"].items())
        hints = "; ".join(answer["suggestions"]) or "a bigger device or more ranks"
        raise ConfigError(f"stage='auto': no plan fits in {memory / 2**30:.2f} GiB per rank "
                          f"({tried}). What would fit: {hints}")
    plan = answer["recommended"]
    budget = answer.get("device_budget")
    stage, offload, params_on_host = (3, False, False) if budget is not None else _PLAN_STAGES[plan]
    choice = AutoChoice(stage, offload, plan, answer["totals"][plan], memory, params_on_host, budget)
    if comm.rank == 0:
        print(f"shardengine: stage='auto' chose {plan} (stage {stage}"
              f"{', parameters and optimizer on the host' if params_on_host else ''}"
              f"{_budget_words(budget)}"
              f"{', optimizer offload' if offload and not params_on_host else ''}): estimated {choice.total_bytes / 2**30:.2f} "
              f"GiB of {memory / 2**30:.2f} GiB per rank on {comm.world_size} rank(s)"
              + (f", sharded within groups of {cfg.shard_group_size}" if stage and cfg.shard_group_size
                 not in (None, comm.world_size) else ""), flush=True)
    return choice


def _budget_words(budget: Optional[int]) -> str:
    if budget is None:
        return ""
    return f", {budget / 2**20:.1f} MiB of model states kept on the device, the other units' on the host"
