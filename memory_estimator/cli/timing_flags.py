"""The time model's flags: they build a ``TimingRequest`` for ``plan/timed.py`` and print its answer.

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
from dataclasses import dataclass, replace
from typing import Any, Optional

from shardengine.engine_facts import Compression, ConfigError, parse_compression

from ..timing.collectives import ALGORITHMS
from ..errors import EstimatorInputError
from ..hardware.interconnects import CATALOG as LINKS, THIS_MACHINE, Link, usual_gpus_per_node
from ..plan.timed import DEFAULT_INTERCONNECT, OBJECTIVES, TimedEstimate, TimingRequest, time_estimate
_TIMING_FLAGS = ("nodes", "gpus_per_node", "interconnect", "intra_node", "compute_efficiency", "peak_tflops", "tf32",
                 "grad_accum", "shard_group_size", "collective_algorithm", "compression", "p2p")


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The argument group of the time model (every default None: "not asked for")."""
    group = parser.add_argument_group("time per step (any of these turns it on)")
    group.add_argument("--nodes", type=int, help="nodes; the world size is nodes x --gpus-per-node")
    group.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the device's usual node, 8 for A100/H100; "
                            "this-machine: one node)")
    group.add_argument("--interconnect", help=f"inter-node link: {', '.join(LINKS)}, {THIS_MACHINE}, or a rate per "
                                              "direction such as 400Gb/s/node or 50GB/s (per GPU by default; "
                                              f"',8us' sets the latency; default {DEFAULT_INTERCONNECT})")
    group.add_argument("--intra-node", help="intra-node link: a catalog name or a rate such as 200GB/s (default: the "
                                            "device's usual one, e.g. nvlink4 for H100)")
    group.add_argument("--p2p", choices=("on", "off"), default=None,
                       help="off: no GPU peer-to-peer (NCCL_P2P_DISABLE=1): intra-node traffic is staged through "
                            "host memory, half the link's rate")
    group.add_argument("--compute-efficiency", type=float,
                       help="price every FLOP at peak x this (default: none; the step is the sum of its "
                            "operations, each at its kernel's published rate, timing/operations.py and "
                            "hardware/achievable.py; calibrated machines: measured)")
    group.add_argument("--peak-tflops", type=float, help="device peak TFLOP/s, for devices not in the catalog "
                                                         "(a catalog device keeps its generation's kernel rates)")
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


@dataclass(frozen=True)
class Topology:
    """The cluster the flags describe: ``world_size`` ranks, and when the time model is asked
    for (``timed``), ``nodes`` x ``gpus_per_node`` with ``note`` saying what was assumed.
    ``flags_given``: the time-model flags the user gave, before any was filled in."""

    world_size: int | float
    nodes: Optional[int]
    gpus_per_node: Optional[int]
    timed: bool
    flags_given: tuple[str, ...]
    note: Optional[str] = None


def resolve_topology(args: argparse.Namespace) -> Topology:
    """The world size from --nodes x --gpus-per-node (refusing a --gpus that disagrees).

    [Note: node size] Given only ``--gpus``, the ranks are spread over nodes of the device's
    usual size (8 for H100/A100 SXM): a 64-GPU run on one 64-GPU node would send nothing
    between nodes and pick a different plan. ``Topology.note`` says what was assumed.
    """
    given = _flags_given(args)
    if not timing_requested(args):
        return Topology(args.world_size, args.nodes, args.gpus_per_node, timed=False, flags_given=given)
    for flag in ("nodes", "gpus_per_node", "grad_accum", "shard_group_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise EstimatorInputError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    world, note = int(args.world_size), None
    if args.nodes is None and args.gpus_per_node is None:
        nodes, per_node, note = _assumed_nodes(args, world)
    elif args.nodes is None:
        per_node = args.gpus_per_node
        nodes = 1 if world == 1 else world // per_node
    else:
        nodes = args.nodes
        per_node = args.gpus_per_node or max(1, world // nodes)
    if world != 1 and world != nodes * per_node:
        raise EstimatorInputError(f"--gpus {world} disagrees with --nodes {nodes} x --gpus-per-node {per_node}")
    return Topology(nodes * per_node, nodes, per_node, timed=True, flags_given=given, note=note)


def _assumed_nodes(args: argparse.Namespace, world: int) -> tuple[int, int, Optional[str]]:
    """Nodes x GPUs per node for ``--gpus`` alone (nodes of the device's usual size), and the note
    saying what was assumed."""
    device = _device_name(args)
    usual = usual_gpus_per_node(device)
    if usual is None or world <= usual:
        note = None if world <= 1 else (f"assumed all {world} ranks on one node ({device}"
                                        + (f"'s usual node holds {usual}" if usual else "") + "); "
                                        "give --nodes/--gpus-per-node to change")
        return 1, world, note
    if world % usual:
        raise EstimatorInputError(f"--gpus {world} is not a whole number of {device}'s usual {usual}-GPU "
                                  "nodes; give --nodes and --gpus-per-node")
    return world // usual, usual, (f"assumed {usual} GPUs per node ({device}'s usual node), {world // usual} "
                                   "nodes; give --gpus-per-node (or --nodes) to change")


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


def timing_request(args: argparse.Namespace, topology: Topology) -> TimingRequest:
    """The cluster and objective the time-model flags ask for, on the resolved ``topology``."""
    return TimingRequest(
        nodes=topology.nodes, gpus_per_node=topology.gpus_per_node, interconnect=args.interconnect,
        intra_node=args.intra_node, compute_efficiency=args.compute_efficiency, peak_tflops=args.peak_tflops,
        tf32=bool(args.tf32), p2p=args.p2p != "off", grad_accum=args.grad_accum or 1, shard_group_size=args.shard_group_size,
        collective_algorithm=args.collective_algorithm or "auto", compression=args.compression,
        objective=args.objective, calibration=getattr(args, "calibration", None), node_size_note=topology.note)


def timed_answer(request: Optional[TimingRequest], flags_given: tuple[str, ...], result) -> Optional[TimedEstimate]:
    """The time model on a finished memory estimate; None when no time-model flag asked for it."""
    if request is None or accumulation_only_without_rate(request, flags_given, result):
        return None
    return time_estimate(result, request)


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


# --------------------------------------------------------------------------- output


def _link_text(link: Link) -> str:
    return f"{link.name} ({link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {link.latency_s * 1e6:.3g} µs)"


def format_timing(timed: Optional[TimedEstimate], note: Optional[str] = None) -> str:
    """The time table: one column per plan (hybrid ones included), below the memory table; ``note``
    (``tf32_note``) after it."""
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
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def timing_json(payload: dict[str, Any], timed: Optional[TimedEstimate], note: Optional[str] = None) -> dict[str, Any]:
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
    notes = payload.get("notes", []) + [line for line in (timed.node_size_note, note) if line]
    return {**payload, "plans": plans, "topology": topology, "objective": timed.objective,
            "recommended": timed.recommended, "recommended_least_sharded": timed.least_sharded, "notes": notes}


def accumulation_only_without_rate(request: TimingRequest, flags_given: tuple[str, ...], result) -> bool:
    """``--grad-accum`` was the only time-model flag and the device has no compute rate (a
    ``--gpu-memory`` device): the flag's memory effect is answered, the time is not asked for."""
    others = [flag for flag in flags_given if flag != "grad_accum"]
    from ..hardware.rates import CATALOG as RATES

    name = result.device.name
    return (not others and request.objective != "fastest" and name not in RATES
            and not name.startswith(THIS_MACHINE))


def untimed_note(request: Optional[TimingRequest], flags_given: tuple[str, ...], result):
    """The estimate with a note saying why no time per step is shown, when that is the case."""
    if request is None or not accumulation_only_without_rate(request, flags_given, result):
        return result
    note = (f"no time per step: device {result.device.name!r} has no known compute rate (give --peak-tflops "
            "or a catalog --device to time it); --grad-accum is applied to memory only")
    return replace(result, notes=result.notes + (note,))


def _flags_given(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(flag for flag in _TIMING_FLAGS if getattr(args, flag, None) is not None)
