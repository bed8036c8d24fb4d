"""The time model in the estimator's answer: flags, per-plan step times, the fastest plan.

Off unless asked for (``--nodes``, ``--gpus-per-node``, ``--interconnect``,
``--objective fastest`` or another flag of its group): then every plan of the
memory estimate, plus the hybrid-sharding plans when there are several nodes, gets
a time per step and tokens/s, and ``--objective fastest`` recommends the fastest
plan that fits. The JSON output gains ``topology``, ``objective``, per-plan
``time`` and the hybrid plans (each with ``shard_group_size``); ``recommended``
follows the objective.

>>> from memory_estimator.cli.command import main
>>> main(["--params", "7e9", "--hidden", "4096", "--layers", "32", "--heads", "32", "--vocab", "32000",
...       "--nodes", "2", "--gpus-per-node", "8", "--device", "H100-80GB", "--seq-len", "4096",
...       "--objective", "fastest", "--json"])  # doctest: +ELLIPSIS
{"params": 7000000000, "world_size": 16, ...
0
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from shardengine.errors import ConfigError
from shardengine.policies import Compression, parse_compression

from ..hardware.calibration import Calibration, load_calibration
from ..timing.collectives import ALGORITHMS
from ..errors import EstimatorInputError
from ..hardware.rates import device_rates
from ..hardware.interconnects import CATALOG as LINKS, THIS_MACHINE, Link, default_intra_node, resolve_link, usual_gpus_per_node
from ..terms.model_states import plan_spec
from ..plan.memory import PlanEstimate, plan_estimate
from ..timing.step import Cluster, StepTime, TimedPlan, Workload, hybrid_plans, step_time

OBJECTIVES = ("least-sharded", "fastest")
DEFAULT_INTERCONNECT = "ib-ndr"
_TIMING_FLAGS = ("nodes", "gpus_per_node", "interconnect", "intra_node", "compute_efficiency", "peak_tflops", "tf32",
                 "grad_accum", "shard_group_size", "collective_algorithm", "compression")


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The argument group of the time model (every default None: "not asked for")."""
    group = parser.add_argument_group("time per step (any of these turns it on)")
    group.add_argument("--nodes", type=int, help="nodes; the world size is nodes x --gpus-per-node")
    group.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the device's usual node, 8 for A100/H100; "
                            "this-machine: one node)")
    group.add_argument("--interconnect", help=f"inter-node link: {', '.join(LINKS)} or {THIS_MACHINE} "
                                              f"(default {DEFAULT_INTERCONNECT})")
    group.add_argument("--intra-node", help="intra-node link (default: the device's usual one, e.g. nvlink4 for H100)")
    group.add_argument("--compute-efficiency", type=float,
                       help="achieved / peak FLOP/s (default: by GPU generation, model size and tokens per "
                            "micro-step, efficiency.py; 0.5 x the tokens' factor for generations without a "
                            "published table; calibrated machines: measured)")
    group.add_argument("--peak-tflops", type=float, help="device peak TFLOP/s, for devices not in the catalog "
                                                         "(a catalog device keeps its generation's efficiency)")
    group.add_argument("--tf32", action="store_true", default=None,
                       help="fp32 matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32; "
                            "Ampere, Ada, Hopper: half the 16-bit rate)")
    group.add_argument("--grad-accum", type=int, help="micro-steps per optimizer step (default 1)")
    group.add_argument("--shard-group-size", type=int,
                       help="hybrid sharding's group size for the zero*-hsdpK plans (default: per stage, the "
                            "smallest of 1, 2, 4, ... nodes that fits)")
    group.add_argument("--collective-algorithm", choices=ALGORITHMS, help="default auto: ring or halving-doubling")
    group.add_argument("--compression", type=parse_compression_flag, metavar="SPEC",
                       help="the engine's compression= option: bf16, fp16, int8 or powersgd (gradients), or "
                            "key=value pairs, e.g. grads=int8,params=int8,block_size=256,powersgd_rank=4")
    group.add_argument("--objective", choices=OBJECTIVES, default="least-sharded",
                       help="recommend the least-sharded plan that fits (default) or the fastest")


def timing_requested(args: argparse.Namespace) -> bool:
    return args.objective == "fastest" or any(getattr(args, flag) is not None for flag in _TIMING_FLAGS)


def resolve_topology(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the world size from --nodes x --gpus-per-node (refusing a --gpus that disagrees).

    [Note: node size] Given only ``--gpus``, the ranks are spread over nodes of the device's
    usual size (8 for H100/A100 SXM): a 64-GPU run on one 64-GPU node would send nothing
    between nodes and pick a different plan. ``args.node_size_note`` says what was assumed.
    """
    args.node_size_note = None
    args.timing_flags_given = _flags_given(args)  # before the topology fills --nodes/--gpus-per-node
    if not timing_requested(args):
        return args
    for flag in ("nodes", "gpus_per_node", "grad_accum", "shard_group_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise EstimatorInputError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    world = int(args.world_size)
    if args.nodes is None and args.gpus_per_node is None:
        nodes, per_node = _assumed_nodes(args, world)
    elif args.nodes is None:
        per_node = args.gpus_per_node
        nodes = 1 if world == 1 else world // per_node
    else:
        nodes = args.nodes
        per_node = args.gpus_per_node or max(1, world // nodes)
    if world != 1 and world != nodes * per_node:
        raise EstimatorInputError(f"--gpus {world} disagrees with --nodes {nodes} x --gpus-per-node {per_node}")
    args.nodes, args.gpus_per_node, args.world_size = nodes, per_node, nodes * per_node
    return args


def _assumed_nodes(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """Nodes x GPUs per node for ``--gpus`` alone: nodes of the device's usual size."""
    device = _device_name(args)
    usual = usual_gpus_per_node(device)
    if usual is None or world <= usual:
        if world > 1:
            args.node_size_note = (f"assumed all {world} ranks on one node ({device}"
                                   + (f"'s usual node holds {usual}" if usual else "") + "); "
                                   "give --nodes/--gpus-per-node to change")
        return 1, world
    if world % usual:
        raise EstimatorInputError(f"--gpus {world} is not a whole number of {device}'s usual {usual}-GPU "
                                  "nodes; give --nodes and --gpus-per-node")
    args.node_size_note = (f"assumed {usual} GPUs per node ({device}'s usual node), {world // usual} nodes; "
                           "give --gpus-per-node (or --nodes) to change")
    return world // usual, usual


def _device_name(args: argparse.Namespace) -> str:
    """The catalog name the device flags mean (the estimate itself reports a wrong one)."""
    from ..hardware.devices import THIS_MACHINE as HERE
    from ..hardware.devices import catalog_lookup

    if args.device is None:
        return "A100-80GB" if args.gpu_memory is None else "custom"
    if args.device.startswith(HERE):
        return args.device
    known = catalog_lookup(args.device)
    return known.name if known is not None else args.device


@dataclass(frozen=True)
class TimedEstimate:
    """Step times of every plan (hybrid ones with their own memory), and the objective's pick."""

    cluster: Cluster
    workload: Workload
    objective: str
    plans: tuple[PlanEstimate, ...]            # the memory estimate's plans, then the hybrid ones
    times: tuple[StepTime, ...]                # same order
    group_sizes: tuple[int, ...]
    recommended: Optional[str]
    least_sharded: Optional[str]
    node_size_note: Optional[str] = None       # what was assumed of the nodes (--gpus alone)


def time_estimate(args: argparse.Namespace, result) -> Optional[TimedEstimate]:
    """The time model applied to a finished memory estimate; None when not asked for."""
    if not timing_requested(args) or accumulation_only_without_rate(args, result):
        return None
    calibration = _calibration_if_needed(args, result.device.name)
    cluster = _cluster(args, result, calibration)
    workload = replace(workload_from_estimate(result, args.grad_accum or 1), compression=args.compression)
    _check_compression(args.compression, workload)
    hybrid = _hybrid_choices(result, cluster, args.shard_group_size)
    plans = result.plans + tuple(memory for _, memory in hybrid)
    timed = [TimedPlan(p.name, p.stage, p.offload, disk=p.disk_bytes > 0) for p in result.plans] + [plan for plan, _ in hybrid]
    times = tuple(step_time(plan, workload, cluster) for plan in timed)
    if result.shares is not None:  # the worst rank sets the pace; the step covers the global batch
        tokens = result.shares.global_batch * result.setup.seq_len * workload.grad_accum
        times = tuple(replace(t, tokens_per_step=tokens) for t in times)
    sizes = tuple(plan.shard_group_size or cluster.world_size for plan in timed)
    fitting = [(t.step_s, p.name) for p, t in zip(plans, times) if p.fits]
    fastest = min(fitting)[1] if fitting else None
    chosen = fastest if args.objective == "fastest" else result.recommended
    return TimedEstimate(cluster, workload, args.objective, plans, times, sizes, chosen, result.recommended,
                         getattr(args, "node_size_note", None))


def parse_compression_flag(text: str) -> "Compression":
    """``--compression``: a gradient option's name, or ``key=value`` pairs of :class:`Compression`.

    >>> parse_compression_flag("grads=int8,params=int8,block_size=64").block_size
    64
    """
    if "=" not in text:
        spec: Any = text
    else:
        spec = {}
        for pair in text.split(","):
            key, _, value = pair.partition("=")
            spec[key.strip()] = _number_or_text(value.strip())
    try:
        compression = parse_compression(spec)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if compression is None:
        raise argparse.ArgumentTypeError(f"--compression {text!r} compresses nothing")
    return compression


def _number_or_text(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _check_compression(compression: Optional["Compression"], workload: Workload) -> None:
    """What the engine refuses whatever the plan: a low-precision wire no narrower than the gradients."""
    if compression is None:
        return
    wire = {"bf16": 2, "fp16": 2}.get(compression.grads)
    if wire is not None and workload.param_bytes <= wire:
        raise EstimatorInputError(f"--compression {compression.grads} with {workload.precision} gradients sends "
                                  "nothing less (the engine refuses it); use int8, or fp32 gradients")


def _calibration_if_needed(args, device_name: str) -> Optional[Calibration]:
    names = (args.interconnect, args.intra_node, device_name)
    path = getattr(args, "calibration", None)  # --calibration FILE, else the stored one
    return load_calibration(path and Path(path)) if any(name and name.startswith(THIS_MACHINE)
                                                        for name in names) else None


def _cluster(args, result, calibration) -> Cluster:
    device = device_rates(result.device.name, calibration, args.peak_tflops)
    if getattr(args, "tf32", None):
        from ..hardware.rates import with_tf32

        device = with_tf32(device)
    intra = resolve_link(args.intra_node or default_intra_node(result.device.name), calibration)
    inter = resolve_link(args.interconnect or DEFAULT_INTERCONNECT, calibration)
    return Cluster(args.nodes, args.gpus_per_node, intra, inter, device, args.compute_efficiency,
                   args.collective_algorithm or "auto", model_params=result.stats.params,
                   micro_tokens=result.setup.micro_batch * result.setup.seq_len)


def workload_from_estimate(result, grad_accum: int = 1) -> Workload:
    """The model's buckets and units: the engine's exact layout for a module, else from Ψ."""
    setup, stats = result.setup, result.stats
    arch = stats.architecture
    param_bytes = 4 if setup.precision == "fp32" else 2
    grad_tensors, buffer_groups, shapes = 0, (), ()
    trainable = setup.adapters.trainable(arch) if setup.adapters is not None else None
    trained = stats.params if trainable is None else max(1, trainable)
    if result.exact_engine is not None and result.exact_engine.applies(setup.world_size):
        layout = result.exact_engine.layout
        buckets = tuple(padded for padded, _ in layout.buckets)
        units = tuple((unit[0], unit[1]) for unit in layout.units)
        grad_tensors, buffer_groups, shapes = layout.grad_tensors, layout.buffer_groups, layout.bucket_shapes
    else:
        per_bucket = max(1, setup.bucket_bytes // param_bytes)
        buckets = _split(trained, per_bucket)
        share = trained / stats.params
        units = tuple((u, math.ceil(u * share)) for u in _split(stats.params, stats.largest_unit or stats.params))
    return Workload(stats.params, setup.micro_batch * setup.seq_len, buckets, units,
                    layers=arch.layers if arch else None, hidden=arch.hidden if arch else None,
                    seq_len=setup.seq_len, precision=setup.precision, optimizer=setup.optimizer,
                    checkpointing=setup.checkpointing, grad_accum=grad_accum, prefetch=setup.prefetch_depth,
                    grad_tensors=grad_tensors, buffer_groups=buffer_groups, bucket_shapes=shapes,
                    trainable=trainable, newton_schulz_flops=_muon_flops(setup, stats),
                    outside_params=min(stats.outside_params or 0, stats.params), **kernel_facts(setup, stats))


def _muon_flops(setup, stats) -> float:
    """Newton-Schulz FLOPs of every hidden matrix (embeddings and head step with AdamW)."""
    if setup.optimizer not in ("muon", "muon-adamw"):
        return 0.0
    from ..terms.adapters import linear_shapes
    from ..terms.optimizers import newton_schulz_flops

    arch = stats.architecture
    if arch is None:  # shapes unknown: square matrices of the largest tensor's size
        side = math.isqrt(stats.largest_tensor or stats.params)
        return newton_schulz_flops([(side, side, max(1, stats.params // max(1, side * side)))])
    shapes = []
    for moe, count in ((True, arch.moe_layer_count), (False, arch.layers - arch.moe_layer_count)):
        shapes += [(i, o, n * count) for i, o, n in linear_shapes(arch, moe).values() if count]
    return newton_schulz_flops(shapes)


def _split(total: int, piece: int) -> tuple[int, ...]:
    """``total`` in pieces of ``piece``, the remainder last (the root unit, the last bucket)."""
    whole, rest = divmod(total, piece)
    return (piece,) * whole + ((rest,) if rest else ())


def _hybrid_choices(result, cluster: Cluster, group_size: Optional[int]) -> list[tuple[TimedPlan, PlanEstimate]]:
    """Hybrid plans with their memory. Without an explicit group size, per stage the smallest
    group that fits among a node, two nodes, four ... (smaller groups send less across nodes),
    else the one-node group."""
    if group_size is not None:
        return [(plan, _hybrid_memory(result, plan)) for plan in hybrid_plans(cluster, group_size)]
    sizes, k = [], cluster.gpus_per_node
    while k < cluster.world_size and cluster.world_size % k == 0:
        sizes.append(k)
        k *= 2
    chosen = []
    for stage in (1, 2, 3):
        candidates = [hybrid_plans(cluster, k)[stage - 1] for k in sizes]
        estimates = [(plan, _hybrid_memory(result, plan)) for plan in candidates]
        chosen += [next((pair for pair in estimates if pair[1].fits), estimates[0])] if estimates else []
    return chosen


def _hybrid_memory(result, plan: TimedPlan) -> PlanEstimate:
    """Memory of a hybrid plan: the formulas with N -> the group size (the analytic path)."""
    setup = replace(result.setup, world_size=plan.shard_group_size, shard_numel_per_rank=None)
    estimate = plan_estimate(plan_spec(f"zero{plan.stage}"), result.stats, setup, result.device,
                             result.model.activations, result.model.logits, result.overheads)
    return replace(estimate, name=plan.name)


# --------------------------------------------------------------------------- output


def _link_text(link: Link) -> str:
    return f"{link.name} ({link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {link.latency_s * 1e6:.3g} µs)"


def format_timing(timed: Optional[TimedEstimate]) -> str:
    """The time table: one column per plan (hybrid ones included), below the memory table."""
    if timed is None:
        return ""
    c, w = timed.cluster, timed.workload
    device = c.device
    lines = ["", "", f"time per step: {c.nodes} node(s) x {c.gpus_per_node} rank(s); intra-node {_link_text(c.intra)}, "
                 f"inter-node {_link_text(c.inter)}; {device.name} at {c.compute_efficiency:.0%} of "
                 f"{device.peak_flops(w.compute_precision) / 1e12:.4g} TFLOP/s; grad-accum {w.grad_accum}, "
                 f"{timed.times[0].tokens_per_step:,} tokens per step"
                 + (f"; compression {w.compression}" if w.compression else "")
                 + (f"\n  ({timed.node_size_note})" if timed.node_size_note else ""), ""]
    rows = [["fits"] + ["yes" if p.fits else "no" for p in timed.plans],
            ["memory (GiB)"] + [f"{p.total / 2**30:.2f}" for p in timed.plans],
            ["shard group"] + [str(k) for k in timed.group_sizes]]
    for label, value in (("compute s", lambda t: t.compute_s), ("optimizer s", lambda t: t.optimizer_s),
                         ("comm s", lambda t: t.comm_s), ("comm exposed s", lambda t: t.exposed_comm_s),
                         ("step s", lambda t: t.step_s)):
        rows.append([label] + [f"{value(t):.4g}" for t in timed.times])
    rows.append(["tokens/s"] + [f"{t.tokens_per_s:,.0f}" for t in timed.times])
    rows.append(["GB intra/step"] + [f"{t.ring_bytes('intra') / 1e9:.3g}" for t in timed.times])
    rows.append(["GB inter/step"] + [f"{t.ring_bytes('inter') / 1e9:.3g}" for t in timed.times])
    header = ["per rank"] + [p.name for p in timed.plans]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    render = lambda row: "  ".join(cell.ljust(wd) if i == 0 else cell.rjust(wd)  # noqa: E731
                                   for i, (cell, wd) in enumerate(zip(row, widths)))
    lines += [render(header), "  ".join("-" * wd for wd in widths)] + [render(row) for row in rows]
    fastest = min(((t.step_s, p.name) for p, t in zip(timed.plans, timed.times) if p.fits), default=None)
    lines.append("")
    lines.append(f"fastest that fits: {fastest[1] if fastest else 'none'}; objective {timed.objective}: "
                 f"recommended {timed.recommended or 'none'}")
    return "\n".join(lines)


def timing_json(payload: dict[str, Any], timed: Optional[TimedEstimate]) -> dict[str, Any]:
    """The estimator's JSON with the time model's fields added (nothing removed or renamed)."""
    if timed is None:
        return payload
    from dataclasses import asdict

    c = timed.cluster
    by_name = {p["name"]: p for p in payload["plans"]}
    plans = []
    for plan, time, group in zip(timed.plans, timed.times, timed.group_sizes):
        entry = dict(by_name.get(plan.name) or plan.to_json_dict())
        entry["shard_group_size"] = group
        entry["time"] = time.to_json_dict()
        plans.append(entry)
    topology = {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "world_size": c.world_size,
                "intra_node": asdict(c.intra), "inter_node": asdict(c.inter),
                "compute_efficiency": c.compute_efficiency,
                "peak_flops": c.device.peak_flops(timed.workload.compute_precision),
                "grad_accum": timed.workload.grad_accum, "collective_algorithm": c.algorithm,
                "compression": asdict(timed.workload.compression) if timed.workload.compression else None,
                "gpus_per_node_assumed": timed.node_size_note is not None, "node_size_note": timed.node_size_note}
    notes = payload.get("notes", []) + ([timed.node_size_note] if timed.node_size_note else [])
    return {**payload, "plans": plans, "topology": topology, "objective": timed.objective,
            "recommended": timed.recommended, "recommended_least_sharded": timed.least_sharded, "notes": notes}


def accumulation_only_without_rate(args: argparse.Namespace, result) -> bool:
    """``--grad-accum`` was the only time-model flag and the device has no compute rate (a
    ``--gpu-memory`` device): the flag's memory effect is answered, the time is not asked for."""
    given = getattr(args, "timing_flags_given", None)
    others = [flag for flag in (_flags_given(args) if given is None else given) if flag != "grad_accum"]
    from ..hardware.rates import CATALOG as RATES

    name = result.device.name
    return (not others and args.objective != "fastest" and name not in RATES
            and not name.startswith(THIS_MACHINE))


def untimed_note(args: argparse.Namespace, result):
    """The estimate with a note saying why no time per step is shown, when that is the case."""
    if not (timing_requested(args) and accumulation_only_without_rate(args, result)):
        return result
    note = (f"no time per step: device {result.device.name!r} has no known compute rate (give --peak-tflops "
            "or a catalog --device to time it); --grad-accum is applied to memory only")
    return replace(result, notes=result.notes + (note,))


def _flags_given(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(flag for flag in _TIMING_FLAGS if getattr(args, flag, None) is not None)


def kernel_facts(setup, stats) -> dict[str, Any]:
    """The Workload fields of the kernels around the matmuls: autocast's dtype, a quantized
    base's weights, compile and fused norms, the shapes their traffic scales with."""
    from ..terms.adapters import BASE_DTYPES

    arch, adapters = stats.architecture, setup.adapters
    facts: dict[str, Any] = dict(compute_dtype=setup.amp, compile=setup.compile, fused_norm=setup.fused_norm)
    if arch is not None:
        facts.update(mlp_width=arch.width, gated_mlp=arch.gated_mlp, norms_per_layer=arch.norms_per_layer)
    if adapters is not None and adapters.quantized:
        per_element = BASE_DTYPES[adapters.base_dtype]
        facts.update(quantized_numel=_quantized_numel(stats, adapters, per_element), quantized_bytes=per_element)
    return facts


def _quantized_numel(stats, adapters, per_element: float) -> int:
    """The blocks' linear weights (what bitsandbytes and torchao quantize); without the shapes,
    the frozen base less what ``frozen_storage_bytes`` keeps in 16 bits."""
    from ..terms.adapters import frozen_numel, frozen_storage_bytes, linear_shapes

    arch = stats.architecture
    if arch is not None:
        return sum(count * i * o * n for moe, count in ((True, arch.moe_layer_count),
                                                        (False, arch.layers - arch.moe_layer_count))
                   for i, o, n in linear_shapes(arch, moe).values())
    frozen = frozen_numel(stats, adapters.trainable(arch))
    sixteen_bit = frozen_storage_bytes(stats, adapters, frozen, 2) - frozen * per_element
    return max(0, round(frozen - sixteen_bit / (2 - per_element)))
