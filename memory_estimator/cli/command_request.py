"""The command line as one typed request, built once from the parsed flags.

[Note: a request flows one way] ``main`` parses the flags, turns them into a
``CommandRequest`` here (the topology resolved, every flag read once), and from then on
each step is a function of the previous step's output: the memory estimate of
``request.estimate``, the time model over that estimate and ``request.timing``, the
objective's pick, the typical length, the colocated rollout, the report. Nothing below
this module reads an ``argparse.Namespace``, and nothing changes the request.

>>> from memory_estimator.cli.command import build_parser
>>> args = build_parser().parse_args(["--params", "7e9", "--gpus", "16", "--device", "H100-80GB",
...                                   "--objective", "fastest"])
>>> request = command_request(args)
>>> request.estimate.training.world_size, request.timing.nodes, request.timing.gpus_per_node
(16, 2, 8)
>>> request.timing.node_size_note
"assumed 8 GPUs per node (H100-80GB's usual node), 2 nodes; give --gpus-per-node (or --nodes) to change"
>>> args.nodes is None  # the parsed flags are left as the user gave them
True
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from ..plan.timed import TimingRequest
from ..request import EngineRequest, EstimateRequest, ModelRequest, TargetRequest, TrainingRequest
from ..terms.overheads import Overheads
from ..terms.rollout import RolloutRequest
from .finetune_flags import fine_tuning_request, kernel_choices
from .rollout_flags import rollout_request
from .timing_flags import Topology, resolve_topology, timing_request


@dataclass(frozen=True)
class Output:
    """How the answer is printed: ``--json``, ``--breakdown``, ``--emit KIND``."""

    json: bool
    breakdown: bool
    emit: Optional[str]


@dataclass(frozen=True)
class CommandRequest:
    """Everything one ``memory-estimator`` command line asks.

    ``timing`` is None unless a time-model flag was given; ``timing_flags`` names the
    time-model flags the user gave (before the topology filled in nodes and GPUs per node);
    ``rollout`` is None without ``--rollout-kv-tokens``."""

    estimate: EstimateRequest
    timing: Optional[TimingRequest]
    timing_flags: tuple[str, ...]
    rollout: Optional[RolloutRequest]
    output: Output


def command_request(args: argparse.Namespace) -> CommandRequest:
    """The typed request these parsed flags ask for (``args`` is read, never changed)."""
    topology = resolve_topology(args)
    return CommandRequest(
        estimate=estimate_request(args, topology),
        timing=timing_request(args, topology) if topology.timed else None,
        timing_flags=topology.flags_given, rollout=rollout_request(args),
        output=Output(json=bool(args.json), breakdown=bool(args.breakdown), emit=args.emit))


def _whole(value: float | None) -> int | float | None:
    """Flags arrive as floats (7e9); hand whole numbers on as int so 7e9 means 7000000000."""
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value


def estimate_request(args: argparse.Namespace, topology: Topology) -> EstimateRequest:
    """The typed request the memory flags ask for, on the resolved ``topology``."""
    device = args.device
    if device is None and args.gpu_memory is None:
        device = "A100-80GB"
    model = ModelRequest(
        params=_whole(args.params), config=args.config, module=args.module,
        largest_layer=_whole(args.largest_layer), hidden=_whole(args.hidden), layers=_whole(args.layers),
        heads=_whole(args.heads), vocab=_whole(args.vocab))
    training = TrainingRequest(
        world_size=_whole(topology.world_size), precision=args.precision, amp=args.amp,
        optimizer=args.optimizer, optimizer_impl=args.optimizer_impl,
        micro_batch=_whole(args.micro_batch), seq_len=_whole(args.seq_len),
        checkpointing=args.checkpointing, fused_attention=args.fused_attention,
        zero_grad_to_none=not args.keep_grads, proportions=args.proportions, **kernel_choices(args),
        mean_seq_len=args.mean_seq_len, length_histogram=args.length_histogram, over_cap=args.over_cap,
        steps=args.steps, expandable_segments=args.expandable_segments)
    engine = EngineRequest(
        name=args.engine, deepspeed_config=args.deepspeed_config, reduce_dtype=args.reduce_dtype,
        gradient_as_bucket_view=args.gradient_as_bucket_view, prefetch_depth=_whole(args.prefetch),
        reshard_after_forward=args.reshard_after_forward, bucket_bytes=args.bucket_size,
        offload_params=args.offload_params, offload_device_budget=args.offload_device_budget, disk=args.offload == "disk")
    target = TargetRequest(device=device, device_memory_bytes=args.gpu_memory, overheads=_overheads(args),
                           calibration=args.calibration, safety_margin=args.safety_margin,
                           module_loading=args.cuda_module_loading, host_memory_bytes=args.host_memory,
                           disk_space_bytes=args.disk_space, ranks_per_node=topology.gpus_per_node,
                           offload_path=args.offload_path)
    return EstimateRequest(model, training, fine_tuning_request(args), engine, target)


def _overheads(args: argparse.Namespace) -> Overheads | None:
    """Explicit flags win; otherwise None lets estimate() pick the device's defaults
    (a CUDA context, NCCL and fragmentation on GPUs, nothing on a CPU)."""
    if (args.cuda_context is None and args.fragmentation is None and not args.no_logits
            and args.nccl_buffers is None):
        return None
    defaults = Overheads()
    return Overheads(
        cuda_context_bytes=args.cuda_context,
        fragmentation_fraction=(defaults.fragmentation_fraction if args.fragmentation is None
                                else args.fragmentation),
        logits_in_overhead=not args.no_logits,
        nccl_bytes=args.nccl_buffers)
