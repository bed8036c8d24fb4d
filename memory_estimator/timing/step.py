"""Time per training step, per plan: compute + optimizer step + the communication not hidden.

Pure functions of the model's shape (:class:`Workload`), the plan (:class:`TimedPlan`)
and the cluster (:class:`Cluster`: nodes x ranks per node, two link classes, the
device's rates); these records and the results are in inputs.py.
Per rank and optimizer step of ``grad_accum`` micro-steps:

* **compute**: the sum of one micro-step's operations, each priced by its mechanism
  (``operations.py``: matmuls by a roofline, flash attention at its kernel's published
  rate, element-wise kernels, the loss, LoRA's adapters and dequantization by their bytes,
  and what the checkpointing policy recomputes), times ``grad_accum``. A given efficiency
  (``--compute-efficiency``, a calibrated machine) prices every FLOP at peak x it instead:
  forward 2·Ψ·t plus attention 4·L·h·s·t, backward twice that (with a frozen base: the
  input gradients plus 2·Ψ_trainable·t), plus :func:`recompute_flops`.
* **Muon**: Newton-Schulz orthogonalization, 5 iterations of 3 matmuls per matrix
  (``newton_schulz_flops``), on every rank at stage 0 and spread over the owners above.
* **optimizer step**: the elements this rank steps (all of Ψ at stage 0, its shard
  above) x bytes touched per element (:data:`STEP_BYTES`), at the device's memory
  bandwidth; offload steps on the host and moves the shard over PCIe both ways; the disk
  tier also reads and writes the fp32 master and state from the node's drive each step.
  With the parameters on the host (``zero3-offload-params``) the shards cross PCIe at each
  gather instead (fp32 up before the forward's and the backward's, the reduced gradient
  down), timed beside the gathers and hidden in their windows (``_host_copies``).
* **communication**: the collectives the engine issues for the plan, bucket by bucket
  (unit by unit at stage 3), each priced by :mod:`.collective_cost` on the slowest
  link its group spans (inter-node when it spans nodes). The bytes are the engine's
  own ring-model accounting (``Communicator.bytes_sent``), so the time model's bytes
  equal ``ShardedModel.ring_model_bytes``; on Gloo the reduce-scatter is an all-reduce
  and the all-gather one broadcast per chunk, as there (see ``shardengine/distributed/communicator.py``).
* **overlap**: gradient reductions run behind the backward pass, stage-3 gathers behind
  the compute they prefetch for; the link's ``overlap`` (1 on GPUs, measured here) is
  the fraction of that window communication can use. Never hidden: one bucket's
  reduction at the end of backward, the first unit's gather, and stages 1-2's
  all-gather after the step (the engine waits for it).

Compression (``Workload.compression``, the engine's ``shard(compression=...)``): the
collectives the engine issues instead, with its byte counts (compressed_reduce.py): a
compressed gradient reduce-scatter is one all-to-all of (N-1)/N of the buffer at the
wire size (int8: plus a 4-byte scale per block), stage 0 adds the all-gather of the
sums in the same format, PowerSGD all-reduces each bucket's P and Q factors and its
uncompressed rest (it needs the bucket shapes: a traced module), stage 3's int8
gathers send int8 shards. Only the wire is priced, not the encoding (measured in
``benchmarks/bench_compression.py``). A plan the engine would refuse the option for
is timed without it: PowerSGD except at stage 0, int8 parameters except at stage 3,
compressed gradients under hybrid sharding. Stage 3 is exact when each unit holds one
bucket (one param group); each further bucket adds up to 4 bytes of scales.

Hybrid sharding (``shard_group_size=k`` < N, plans named ``zero{s}-hsdp{k}``): shard
within groups of k consecutive ranks (a node by default) and replicate across the N/k
groups: gradients reduce-scatter in the group, then the shard is all-reduced across
groups; parameters are gathered in the group only.

>>> w = Workload(params=10**9, tokens_per_micro_step=4096, buckets=(25 * 2**20,) * 40)
>>> c = Cluster(2, 8, intra=resolve_link("nvlink4"), inter=resolve_link("ib-ndr"),
...             device=device_rates("H100-80GB"))
>>> t = step_time(TimedPlan("zero1", 1), w, c)
>>> round(t.compute_s, 3), t.step_s > t.compute_s
(0.044, True)
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from shardengine.engine_facts import (bytes_sent, Compression, offloaded_units, payload_bytes, plan_powersgd,
                               UnitSize, uses_in_place_primitives, vector_bytes)

from .collectives import collective_seconds
from .optimizer_bytes import STEP_BYTES, step_bytes_per_element
from .flat_rate import backward_flops, flat_rate_seconds, forward_flops, recompute_flops
from ..errors import EstimatorInputError
from .inputs import Cluster, CollectiveUse, StepTime, TimedPlan, Workload
from ..hardware.rates import DISK_BYTES_PER_S, HOST_MEMORY_BYTES_PER_S, device_rates
from ..terms.optimizers import state_bytes_per_element
from ..terms.precision import FP32_BYTES
from ..hardware.interconnects import Link, resolve_link

if TYPE_CHECKING:
    from .operations import Operation

PHASES = ("forward", "backward", "backward_last", "after_step")


# --------------------------------------------------------------------------- compute


def compute_seconds(workload: Workload, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of a whole step (``grad_accum`` micro-steps).

    By default the sum of the micro-step's operations, each at its mechanism's rate
    (``operations.py``); a given efficiency (``--compute-efficiency``, or a calibrated
    machine's measured one) prices every FLOP at peak x that efficiency instead."""
    if cluster.efficiency is None and cluster.device.efficiency is None:
        forward = backward = 0.0
        for op, seconds in operation_times(workload, cluster):
            if op.phase == "forward":
                forward += seconds
            else:
                backward += seconds
        return workload.grad_accum * forward, workload.grad_accum * backward
    return flat_rate_seconds(workload, cluster)


def operation_times(workload: Workload, cluster: Cluster) -> list[tuple["Operation", float]]:
    """Each operation of one micro-step with its seconds on ``cluster``'s device."""
    from .operations import device_achievable, micro_step_operations, operation_seconds

    if cluster.device.peak_flops(workload.compute_precision) <= 0:
        raise EstimatorInputError(f"device {cluster.device.name!r} has no compute rate; give --peak-tflops")
    rates = device_achievable(cluster.device)
    return [(op, operation_seconds(op, cluster.device, workload.compute_precision, rates))
            for op in micro_step_operations(workload)]


def optimizer_seconds(workload: Workload, plan: TimedPlan, cluster: Cluster) -> float:
    """The step over this rank's elements; with offload, on the host plus the PCIe round trip."""
    group = _group(plan, cluster)
    trained = workload.params if workload.trainable is None else workload.trainable
    stepped = sum(workload.all_buckets) if plan.stage == 0 else math.ceil(trained / group)
    per_element = step_bytes_per_element(workload)
    # Muon: every rank orthogonalizes every matrix at stage 0; owners only above (optim/whole_tensor.py's owner layout).
    owners = 1 if plan.stage == 0 else group
    newton_schulz = workload.newton_schulz_flops / owners / (cluster.device.peak_flops("bf16")
                                                             * cluster.compute_efficiency)
    on_device = stepped * per_element / cluster.device.step_bytes_per_s + newton_schulz
    if not plan.offload and not plan.params_on_host:
        return on_device
    # a fractional offload steps its host units' share on the host, the rest on the device
    share = 1.0 if plan.offload else plan.host_share
    return (1 - share) * on_device + share * _host_step_seconds(workload, plan, cluster, stepped, per_element)


def _host_step_seconds(workload: Workload, plan: TimedPlan, cluster: Cluster, stepped: int,
                       per_element: int) -> float:
    """The step over ``stepped`` elements on the host, with what crosses PCIe or the disk for it."""
    host_share = cluster.device.step_bytes_per_s if cluster.device.host_is_device \
        else HOST_MEMORY_BYTES_PER_S / cluster.gpus_per_node
    pcie = host_link_rate(cluster)
    # gradient shard down, parameter shard up; with the parameters on the host both cross at
    # each micro-step instead, priced with the gathers (_host_copies)
    round_trip = 0 if plan.params_on_host else stepped * 2 * workload.param_bytes
    seconds = stepped * per_element / host_share + round_trip / pcie
    if plan.disk:  # fp32 master and state: read in, stepped, written back (shardengine/offload/)
        in_files = FP32_BYTES + state_bytes_per_element(workload.optimizer, FP32_BYTES)
        seconds += stepped * 2 * in_files / (DISK_BYTES_PER_S / cluster.gpus_per_node)
    return seconds


# --------------------------------------------------------------------------- communication


def _group(plan: TimedPlan, cluster: Cluster) -> int:
    k = plan.shard_group_size or cluster.world_size
    if k < 1 or cluster.world_size % k:
        raise EstimatorInputError(f"shard group size {k} must divide the world size {cluster.world_size}")
    return k


def _padded(numel: int, ranks: int) -> int:
    return math.ceil(numel / ranks) * ranks


def _engine_bytes_sent(collective: str, nbytes: int, ranks: int, in_place: bool) -> int:
    """The engine's own count (``Communicator.bytes_sent`` is this function): one formula for issued and
    predicted."""
    return bytes_sent(collective, nbytes, ranks, in_place)


def _issued(collective: str, in_place: bool) -> str:
    """The cost kind of what the engine issues (Gloo: reduce-scatter as all-reduce, all-gather as broadcasts)."""
    if in_place and collective == "reduce_scatter":
        return "all_reduce"
    if in_place and collective == "all_gather":
        return "broadcast"
    return collective


def _beta(cluster: Cluster, link_name: str, collective: str, strided: bool) -> float:
    """Seconds per byte a rank's share of a collective sees on ``link_name``.

    [Note: a ring across nodes uses every NIC of the node]
    A group of consecutive ranks that spans nodes is joined by NCCL as several rings
    (channels), each crossing a node boundary through a different NIC: a node's inter-node
    traffic is the same (n-1)/n·S a single ring edge carries, split over its
    ``gpus_per_node`` NICs, so a rank's share crosses at ``gpus_per_node`` x one NIC's
    bandwidth (nccl-tests' multi-node bus bandwidth approaches the node's total NIC
    bandwidth), bounded by the intra-node link. A strided group (one rank per node, hybrid
    sharding's replica all-reduce) and an all-to-all send through each rank's own NIC."""
    link = cluster.link(link_name)
    if link_name != "inter" or strided or collective == "all_to_all" or cluster.gpus_per_node == 1:
        return link.beta
    return max(cluster.intra.beta, link.beta / cluster.gpus_per_node)


def _use(collective: str, buffers: list[int], ranks: int, link_name: str, phase: str, per_step: int,
         cluster: Cluster, strided: bool = False) -> Optional[CollectiveUse]:
    if ranks == 1 or not buffers:
        return None
    link = cluster.link(link_name)
    in_place = _in_place(link)
    issued = _issued(collective, in_place)
    beta = _beta(cluster, link_name, collective, strided)
    seconds = [collective_seconds(issued, b, ranks, link.latency_s, beta, cluster.algorithm) for b in buffers]
    sent = sum(_engine_bytes_sent(collective, b, ranks, in_place) for b in buffers)
    last = seconds[0] if phase == "forward" else seconds[-1]
    return CollectiveUse(collective, tuple(buffers), ranks, link_name, phase, per_step, per_step * sent,
                         per_step * sum(seconds), last)


def _in_place(link: Link) -> bool:
    return uses_in_place_primitives("auto", link.backend)


def plan_collectives(plan: TimedPlan, workload: Workload, cluster: Cluster) -> tuple[CollectiveUse, ...]:
    """What the engine issues per optimizer step for ``plan``, as in its ``ring_model_bytes``."""
    n, k = cluster.world_size, _group(plan, cluster)
    groups, m = n // k, workload.grad_accum
    p, g = workload.param_bytes, workload.param_bytes  # reduce dtype = compute dtype
    inside, across = cluster.group_link(k), cluster.across_groups_link
    wire = _compressed_grads(workload.compression, plan.stage, k, n)
    uses: list[Optional[CollectiveUse]] = []
    if plan.stage == 0:
        link = cluster.group_link(n)
        if wire == "powersgd":
            uses.append(_use("all_reduce", _powersgd_buffers(workload, n), n, link, "backward_last", 1, cluster))
        elif wire:
            messages = [n * _message_bytes(wire, _padded(b, n) // n, workload) for b in workload.all_buckets]
            uses.append(_use("all_to_all", messages, n, link, "backward_last", 1, cluster))
            uses.append(_use("all_gather", messages, n, link, "backward_last", 1, cluster))
        else:
            buffers = [g * _padded(b, n) for b in workload.all_buckets]
            uses.append(_use("all_reduce", buffers, n, link, "backward_last", 1, cluster))
    elif plan.stage in (1, 2):
        phase, times = ("backward_last", 1) if plan.stage == 1 else ("backward", m)
        padded = [_padded(b, k) for b in workload.all_buckets]
        if wire:
            messages = [k * _message_bytes(wire, b // k, workload) for b in padded]
            uses.append(_use("all_to_all", messages, k, inside, phase, times, cluster))
        else:
            uses.append(_use("reduce_scatter", [g * b for b in padded], k, inside, phase, times, cluster))
            uses.append(_use("all_reduce", [g * b // k for b in padded], groups, across, phase, times, cluster,
                             strided=True))
        uses.append(_use("all_gather", [p * b for b in padded], k, inside, "after_step", 1, cluster))
    else:
        units = [(_padded(a, k), _padded(gr, k)) for a, gr in workload.all_units]
        int8_params = workload.compression is not None and workload.compression.params == "int8" and k > 1
        gathers = [k * _message_bytes("int8", a // k, workload) if int8_params else p * a for a, _ in units]
        uses.append(_use("all_gather", gathers, k, inside, "forward", m, cluster))
        if workload.reshard_after_forward:  # else each unit is still gathered when backward reaches it
            uses.append(_use("all_gather", gathers[::-1], k, inside, "backward", m, cluster))
        if wire:
            grads = [k * _message_bytes(wire, gr // k, workload) for _, gr in units if gr]
            uses.append(_use("all_to_all", grads[::-1], k, inside, "backward", m, cluster))
        else:
            grads = [g * gr for _, gr in units if gr]
            uses.append(_use("reduce_scatter", grads[::-1], k, inside, "backward", m, cluster))
            uses.append(_use("all_reduce", [b // k for b in grads[::-1]], groups, across, "backward", m, cluster,
                             strided=True))
        if plan.params_on_host:
            uses += _host_copies(_units_on_host(units, plan.host_share), k, m, cluster, g, plan.disk,
                                 workload.reshard_after_forward)
    uses += _activation_copies(workload, cluster)
    uses += _control_collectives(workload, cluster)
    return tuple(use for use in uses if use is not None)


def _units_on_host(units: list[tuple[int, int]], share: float) -> list[tuple[int, int]]:
    """The units a fractional offload moves (shardengine.flat.residency's rule on these units:
    the root and the last blocks stay resident), in plan order; all of them for a share of 1."""
    if share >= 1:
        return units
    moved = offloaded_units([UnitSize(a, 0) for a, _ in units], fraction=share) if share > 0 else frozenset()
    return [unit for index, unit in enumerate(units) if index in moved]


def _host_copies(units: list[tuple[int, int]], k: int, m: int, cluster: Cluster,
                 grad_bytes: int, disk: bool = False, again_in_backward: bool = True) -> list[CollectiveUse]:
    """zero3-offload-params: before each gather (forward and backward) the unit's fp32 shard is
    copied host to device (the engine casts it into the gather buffer: flat/bucket.py), and each
    reduced gradient shard goes back, over the host link (PCIe). They run with the gathers they
    are issued with, so they hide in the same windows; they send nothing between ranks.
    ``disk`` (zero3-offload-params-disk): each shard is first read from the node's drive, a unit
    ahead of its gather (shardengine/offload/disk_params.py), hidden in the same windows.
    ``again_in_backward=False`` (``reshard_after_forward=False``): backward gathers nothing, so
    it copies and reads no shard up either."""
    pcie = host_link_rate(cluster)
    up = [FP32_BYTES * a // k for a, _ in units]
    down = [grad_bytes * gr // k for _, gr in units[::-1] if gr]
    phases = ("forward", "backward") if again_in_backward else ("forward",)
    copies = [_copies("host_to_device", up if phase == "forward" else up[::-1], phase, pcie, m) for phase in phases]
    copies.append(_copies("device_to_host", down, "backward", pcie, m))
    if disk:
        drive = DISK_BYTES_PER_S / cluster.gpus_per_node  # the node's drive, shared by its ranks
        copies += [_copies("disk_read", up if phase == "forward" else up[::-1], phase, drive, m) for phase in phases]
    return copies


def host_link_rate(cluster: Cluster) -> float:
    """Bytes per second a rank copies between its device and the host: the host link (PCIe),
    or on a CPU a copy within its own memory (read and write at the measured rate)."""
    if cluster.device.host_is_device:
        return cluster.device.step_bytes_per_s / 2
    return resolve_link(cluster.device.host_link).bandwidth_bytes_per_s


def _copies(name: str, buffers: list[int], phase: str, rate: float, per_step: int) -> CollectiveUse:
    """Copies over the host link (or a drive) at ``rate``, issued with the phase they hide in;
    they send nothing between ranks."""
    seconds = [b / rate for b in buffers] or [0.0]  # a fraction may move no unit of a small model
    last = seconds[0] if phase == "forward" else seconds[-1]
    return CollectiveUse(name, tuple(buffers), 1, "host", phase, per_step, 0, per_step * sum(seconds), last)


def _activation_copies(workload: Workload, cluster: Cluster) -> list[CollectiveUse]:
    """Activation offload: each unit's saved activations go to pinned host memory on a copy
    stream as forward saves them and come back ahead of the unit's backward, at the host link's
    rate or the node's host memory bandwidth shared by its ranks, whichever is less; they hide
    behind the compute of the same phase."""
    units = list(workload.offloaded_activations)
    if not units:
        return []
    rate = min(host_link_rate(cluster), HOST_MEMORY_BYTES_PER_S / cluster.gpus_per_node)
    m = workload.grad_accum
    return [_copies("activations_to_host", units, "forward", rate, m),
            _copies("activations_to_device", units[::-1], "backward", rate, m)]


def _compressed_grads(compression: Optional["Compression"], stage: int, k: int, n: int) -> Optional[str]:
    """The gradient compression the engine would apply to this plan (see the module's docstring)."""
    if compression is None or compression.grads is None or n == 1:
        return None
    if compression.grads == "powersgd":
        return "powersgd" if stage == 0 else None
    return compression.grads if stage == 0 or k == n else None


def _message_bytes(wire: str, chunk: int, workload: Workload) -> int:
    """Bytes of one rank's chunk of ``chunk`` elements on the wire (shardengine/distributed/compression/codecs.py)."""
    if wire == "int8":
        return payload_bytes(chunk, workload.compression.block_size)
    return 2 * chunk  # bf16 / fp16


def _powersgd_buffers(workload: Workload, n: int) -> list[int]:
    """fp32 bytes of each bucket's three all-reduces: P factors, Q factors, the uncompressed rest."""
    if not workload.bucket_shapes:
        raise EstimatorInputError("timing PowerSGD needs the model's tensor shapes: give --module or --config")
    c = workload.compression
    buffers = []
    for shapes in workload.bucket_shapes:
        plan = plan_powersgd(shapes, c.powersgd_rank, c.powersgd_min_compression_rate)
        buffers += [4 * numel for numel in (plan.p_numel, plan.q_numel, plan.dense_numel) if numel]
    return buffers


def _control_collectives(workload: Workload, cluster: Cluster) -> list[Optional[CollectiveUse]]:
    """The step's agreement all-reduce (shardengine/step/agreement.py) and the buffer broadcasts."""
    everyone = cluster.group_link(cluster.world_size)
    return [_use("all_reduce", [vector_bytes(workload.grad_tensors)], cluster.world_size, everyone,
                 "after_step", 1, cluster),
            _use("broadcast", list(workload.buffer_groups), cluster.world_size, everyone,
                 "after_step", workload.grad_accum, cluster)]


def exposed_seconds(uses: tuple[CollectiveUse, ...], forward_s: float, backward_s: float,
                    workload: Workload, overlap: float) -> float:
    """Communication left on the critical path after hiding what the schedule allows."""
    per_micro_fwd, per_micro_bwd = forward_s / workload.grad_accum, backward_s / workload.grad_accum
    windows = {"forward": per_micro_fwd * workload.grad_accum, "backward": backward_s,
               "backward_last": per_micro_bwd, "after_step": 0.0}
    if workload.prefetch == 0:  # stage 3 gathers just in time: nothing runs ahead
        windows["forward"] = 0.0
    exposed = 0.0
    for phase in PHASES:
        in_phase = [u for u in uses if u.phase == phase]
        total = sum(u.seconds for u in in_phase)
        never = sum(u.last_call_s * u.per_step for u in in_phase)
        exposed += total - overlap * min(max(total - never, 0.0), windows[phase])
    return exposed


def step_time(plan: TimedPlan, workload: Workload, cluster: Cluster) -> StepTime:
    """Seconds per optimizer step of ``plan``, its parts, and the collectives behind them."""
    forward, backward = compute_seconds(workload, cluster)
    uses = plan_collectives(plan, workload, cluster)
    overlap = min(cluster.intra.overlap, cluster.inter.overlap)
    tokens = workload.tokens_per_micro_step * workload.grad_accum * cluster.world_size
    return StepTime(plan.name, forward, backward, optimizer_seconds(workload, plan, cluster),
                    sum(u.seconds for u in uses), exposed_seconds(uses, forward, backward, workload, overlap),
                    tokens, uses)


def hybrid_plans(cluster: Cluster, group_size: Optional[int] = None) -> tuple[TimedPlan, ...]:
    """Stages 1-3 sharded within groups of ``group_size`` (default: a node), replicated across."""
    k = group_size or cluster.gpus_per_node
    _group(TimedPlan("", 1, shard_group_size=k), cluster)
    if k >= cluster.world_size:
        return ()  # one group: plain sharding
    return tuple(TimedPlan(f"zero{stage}-hsdp{k}", stage, shard_group_size=k) for stage in (1, 2, 3))


__all__ = ["Workload", "Cluster", "TimedPlan", "StepTime", "CollectiveUse", "step_time", "plan_collectives",
           "STEP_BYTES", "forward_flops", "backward_flops", "recompute_flops", "compute_seconds", "operation_times",
           "optimizer_seconds", "exposed_seconds", "hybrid_plans", "resolve_link", "device_rates"]
