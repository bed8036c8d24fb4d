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

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import psutil
import torch
from torch import nn

from .distributed.communicator import Communicator
from .errors import ConfigError
from .config import ShardConfig, known_options
from .distributed.launch import local_world_size

_PRECISION = {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# A 16-bit model sharded without param_dtype steps its own 16-bit weights: no fp32 master.
_PURE = {torch.bfloat16: "pure-bf16", torch.float16: "pure-fp16"}


def _precision(model: nn.Module, cfg: ShardConfig) -> str:
    if cfg.param_dtype is not None:
        return _PRECISION[cfg.param_dtype]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return _PURE.get(dtypes.pop(), "fp32") if len(dtypes) == 1 else "fp32"


@dataclass(frozen=True)
class AutoChoice:
    """What ``stage="auto"`` chose (``model.auto_plan``): the options ``shard()`` applied, and the
    loop's micro-batch and accumulation, which it cannot apply (the training script does).

    ``offload_params``: False, True (every unit's parameters on the host) or a fraction;
    ``device_budget``: bytes of model states kept on the device (the other units on the host).
    ``checkpointing`` / ``activation_offload``: the activation levers (``shard()``'s
    ``activation_checkpointing=`` / ``activation_offload=``). ``lines``: the plan as printed,
    one line per lever and why. ``step_s``: the predicted time per optimizer step (None when
    this machine's rates are unknown)."""

    stage: int
    offload_optimizer: bool
    plan: str
    total_bytes: int
    device_bytes: int
    offload_params: Union[bool, float] = False
    device_budget: Optional[int] = None
    reshard_after_forward: bool = True
    checkpointing: str = "none"
    activation_offload: bool = False
    micro_batch: Optional[int] = None
    grad_accum: int = 1
    step_s: Optional[float] = None
    host_bytes_per_node: int = 0
    lines: tuple[str, ...] = ()
    host_bytes: int = 0              # per rank: host states and offloaded activations as planned

    def activation_options(self) -> dict[str, Any]:
        """``shard()``'s activation keywords for this choice (none when it keeps the defaults)."""
        options: dict[str, Any] = {}
        if self.checkpointing != "none":
            options["activation_checkpointing"] = self.checkpointing
        if self.activation_offload:
            options["activation_offload"] = True
        return options


def _device_memory_bytes(model: nn.Module, comm: Communicator) -> int:
    """Memory this rank may use: free device memory (or its share of available RAM),
    plus what the model already occupies there; the smallest over all ranks."""
    held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    params = [p for p in model.parameters() if not p.is_meta]
    if params and params[0].is_cuda:
        free = torch.cuda.mem_get_info(params[0].device)[0]
    else:
        free = psutil.virtual_memory().available // _ranks_here()
    return min(comm.all_gather_object(free + held))


def _ranks_here() -> int:
    return local_world_size() or 1


def _host_memory_bytes(model: nn.Module, comm: Communicator) -> int:
    """RAM a node may still give (the least over the ranks' nodes), plus what the model
    already occupies there (its parameters move off the host when sharded)."""
    on_host = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta and not p.is_cuda)
    return min(comm.all_gather_object(int(psutil.virtual_memory().available) + on_host))


def _gpu_name(model: nn.Module) -> Optional[str]:
    params = [p for p in model.parameters() if not p.is_meta]
    return torch.cuda.get_device_name(params[0].device) if params and params[0].is_cuda else None


def _estimate_on_rank0(model, optimizer, comm, cfg: ShardConfig, micro_batch, seq_len,
                       example_inputs, memory_bytes: int, host_bytes: int) -> dict[str, Any]:
    """Rank 0 estimates; the others take its answer (estimates could differ by a byte of free RAM).
    An estimate that fails on rank 0 fails on every rank, with rank 0's error, instead of leaving
    the others waiting for an answer."""
    answer: dict[str, Any] = {}
    if comm.rank == 0:
        try:
            import memory_estimator as me
            from memory_estimator.plan.auto_plan import auto_device

            request = _request(me, auto_device(_gpu_name(model)), model, optimizer, comm, cfg, micro_batch,
                               seq_len, example_inputs, memory_bytes, host_bytes)
            answer = me.auto_plan(request, local_world_size=_ranks_here(), activation_levers=_activation_levers(),
                                  fixed_activations=_fixed_activations(cfg))
        except Exception as error:  # noqa: BLE001 - raised on every rank below, as one ConfigError
            answer = {"error": f"{type(error).__name__}: {error}"}
            comm.all_gather_object(answer)
            raise _estimate_failed(answer) from error
    answer = comm.all_gather_object(answer)[0]
    if "error" in answer:
        raise _estimate_failed(answer)
    return answer


def _estimate_failed(answer: dict[str, Any]) -> ConfigError:
    """The same error on every rank, so one ``except se.ConfigError`` catches it wherever it runs."""
    return ConfigError(f"stage='auto': the memory estimate failed on rank 0 ({answer['error']})")


def _activation_levers() -> bool:
    """Whether this engine applies activation checkpointing and offload itself (``shard()`` takes
    ``activation_checkpointing=``): then ``auto`` searches them."""
    return "activation_checkpointing" in known_options()


def _fixed_activations(cfg: ShardConfig) -> bool:
    """The user chose the activation levers (``auto`` keeps them as given)."""
    return getattr(cfg, "activation_checkpointing", "none") != "none" or bool(getattr(cfg, "activation_offload", False))


def _request(me, device: Optional[str], model, optimizer, comm, cfg: ShardConfig, micro_batch, seq_len,
             example_inputs, memory_bytes: int, host_bytes: int):
    """The estimator's request for this run on this machine (``me``: the estimator, imported by the caller)."""
    options = me.EngineOptions(
        bucket_mb=cfg.bucket_mb, wrap=cfg.wrap, wrap_min_params=cfg.wrap_min_params,
        prefetch=cfg.prefetch, max_inflight_buckets=cfg.max_inflight_buckets,
        reduce_precision=_PRECISION[cfg.reduce_dtype] if cfg.reduce_dtype else None,
        reduces_in_place=comm.reduces_in_place, shard_group_size=cfg.shard_group_size,
        reshard_after_forward=cfg.reshard_after_forward)
    return me.EstimateRequest(
        model=me.ModelRequest(module=model, example_inputs=example_inputs),
        training=me.TrainingRequest(world_size=comm.world_size, precision=_precision(model, cfg),
                                    optimizer=optimizer, micro_batch=micro_batch, seq_len=seq_len,
                                    checkpointing=getattr(cfg, "activation_checkpointing", "none"),
                                    activation_offload=bool(getattr(cfg, "activation_offload", False))),
        engine=me.EngineRequest(options=options),
        # CPU: no CUDA context or allocator overheads
        target=me.TargetRequest(device=device, device_memory_bytes=memory_bytes, host_memory_bytes=host_bytes,
                                ranks_per_node=min(_ranks_here(), comm.world_size), offload_path=cfg.offload_path))


def choose_plan(model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                cfg: ShardConfig, micro_batch: Optional[int], seq_len: Optional[int],
                example_inputs: Optional[Callable] = None,
                memory_budget_bytes: Optional[int] = None) -> AutoChoice:
    """The fastest plan the estimator says fits the device, the host and the disk, with its
    activations counted; a clear error when none does."""
    if micro_batch is None or seq_len is None:
        raise ConfigError("stage='auto' needs micro_batch= and seq_len= to estimate activations")
    memory = _device_memory_bytes(model, comm)
    if memory_budget_bytes is not None:
        if memory_budget_bytes <= 0:
            raise ConfigError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
        memory = min(memory, int(memory_budget_bytes))
    answer = _estimate_on_rank0(model, optimizer, comm, cfg, micro_batch, seq_len, example_inputs, memory,
                                _host_memory_bytes(model, comm))
    sizes = answer["sizes"]  # the estimator's own wording of each size: GiB for a GPU, KiB for a toy budget
    if answer["recommended"] is None:
        tried = ", ".join(f"{name} {sizes[name]}" for name in answer["totals"])
        hints = "; ".join(answer["suggestions"]) or "a bigger device or more ranks"
        raise ConfigError(f"stage='auto': no plan fits in {sizes['budget']} per rank "
                          f"({tried}; activations {answer['activations']}). What would fit: {hints}")
    choice = AutoChoice(answer["stage"], answer["offload_optimizer"], answer["recommended"], answer["total_bytes"],
                        memory, answer["offload_params"], answer["device_budget"], answer["reshard_after_forward"],
                        answer["checkpointing"], answer["activation_offload"], answer["micro_batch"],
                        answer["grad_accum"], answer["step_s"], answer["host_bytes_per_node"], tuple(answer["lines"]),
                        answer["host_bytes"])
    if comm.rank == 0:
        grouped = (f", sharded within groups of {cfg.shard_group_size}" if choice.stage and cfg.shard_group_size
                   not in (None, comm.world_size) else "")
        print(f"shardengine: stage='auto' chose {choice.plan} (stage {choice.stage}) on {comm.world_size} rank(s), "
              f"{sizes['budget']} per rank{grouped}:\n" + "\n".join(f"  {line}" for line in choice.lines),
              flush=True)
    return choice
