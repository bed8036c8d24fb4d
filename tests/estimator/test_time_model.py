"""The step-time model's pure functions: alpha-beta costs, monotonicity, overlap, hybrid traffic."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from memory_estimator.timing.collectives import (collective_seconds, halving_doubling_all_reduce,
                                              parameter_server_all_reduce, reduce_broadcast_all_reduce,
                                              ring_all_reduce, ring_reduce_scatter)
from memory_estimator.errors import EstimatorInputError
from memory_estimator.hardware.rates import DISK_BYTES_PER_S, device_rates
from memory_estimator.hardware.interconnects import CATALOG, Link, resolve_link
from shardengine.step.agreement import vector_bytes
from memory_estimator.timing.step import (Cluster, TimedPlan, Workload, hybrid_plans, optimizer_seconds,
                                          plan_collectives, step_time)

ALGORITHMS = [ring_all_reduce, halving_doubling_all_reduce, reduce_broadcast_all_reduce,
              parameter_server_all_reduce]
PLANS = [TimedPlan("ddp", 0), TimedPlan("zero1", 1), TimedPlan("zero2", 2), TimedPlan("zero3", 3),
         TimedPlan("zero3-offload", 3, offload=True)]
ranks = st.integers(1, 64)
sizes = st.integers(0, 1 << 32)
alphas = st.floats(0, 1e-3)
betas = st.floats(1e-12, 1e-6)


@given(sizes, ranks, alphas, betas, st.floats(1.01, 100))
def test_every_algorithm_is_monotone_in_bandwidth_and_size(nbytes, n, alpha, beta, factor):
    for cost in ALGORITHMS:
        assert cost(nbytes, n, alpha, beta * factor) >= cost(nbytes, n, alpha, beta)
        assert cost(nbytes * 2, n, alpha, beta) >= cost(nbytes, n, alpha, beta)
        assert cost(nbytes, n, alpha * factor, beta) >= cost(nbytes, n, alpha, beta)


@given(sizes, st.integers(2, 64), betas)
def test_ring_and_halving_doubling_send_the_same_bytes_for_powers_of_two(nbytes, n, beta):
    n = 1 << (n.bit_length() - 1)
    assert math.isclose(ring_all_reduce(nbytes, n, 0, beta), halving_doubling_all_reduce(nbytes, n, 0, beta),
                        rel_tol=1e-9, abs_tol=1e-15)
    # ... and the ring's bandwidth term is the ring model: 2(n-1)/n S bytes per rank.
    assert math.isclose(ring_all_reduce(nbytes, n, 0, beta), 2 * (n - 1) / n * nbytes * beta,
                        rel_tol=1e-9, abs_tol=1e-15)


@given(st.integers(4, 64), st.floats(1e-6, 1e-3))
def test_halving_doubling_wins_where_latency_dominates(n, alpha):
    assert halving_doubling_all_reduce(0, n, alpha, 1e-9) < ring_all_reduce(0, n, alpha, 1e-9)
    assert collective_seconds("all_reduce", 0, n, alpha, 1e-9) == halving_doubling_all_reduce(0, n, alpha, 1e-9)


def test_parameter_server_bandwidth_grows_with_workers_and_the_ring_does_not():
    ps = [parameter_server_all_reduce(1e8, n, 0, 1e-9) for n in (2, 4, 8, 16)]
    ring = [ring_all_reduce(1e8, n, 0, 1e-9) for n in (2, 4, 8, 16)]
    assert [round(t / ps[0], 6) for t in ps] == [1, 3, 7, 15]   # (n-1) S at rank 0, both ways
    assert all(t <= 2 * 1e8 * 1e-9 for t in ring)               # never more than 2 S
    assert ring_reduce_scatter(1e8, 4, 0, 1e-9) == pytest.approx(0.75 * 0.1)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="n >= 1"):
        ring_all_reduce(1, 0, 0, 0)
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds("gather", 1, 2, 0, 0)
    with pytest.raises(EstimatorInputError, match="did you mean ib-ndr"):
        resolve_link("ib-nrd")
    with pytest.raises(EstimatorInputError, match="bandwidth > 0"):
        Link("x", 0, 1e-6)
    with pytest.raises(EstimatorInputError, match="no compute rate"):
        device_rates("custom")


# --------------------------------------------------------------------------- whole steps


def _workload(params=2_000_000_000, grad_accum=1, precision="bf16", checkpointing="none", prefetch=1):
    unit = params // 40
    return Workload(params, 4096, buckets=tuple([12_500_000] * (params // 12_500_000)),
                    units=tuple([(unit, unit)] * 40), layers=40, hidden=5120, seq_len=4096,
                    precision=precision, grad_accum=grad_accum, checkpointing=checkpointing, prefetch=prefetch)


def _cluster(nodes=4, per_node=8, inter="ib-hdr", intra="nvlink3", scale=1.0, overlap=None, efficiency=None):
    inter_link = CATALOG[inter]
    inter_link = Link(inter_link.name, inter_link.nominal_bytes_per_s * scale, inter_link.latency_s,
                      overlap=inter_link.overlap if overlap is None else overlap)
    intra_link = CATALOG[intra] if overlap is None else Link(intra, CATALOG[intra].nominal_bytes_per_s,
                                                             CATALOG[intra].latency_s, overlap=overlap)
    return Cluster(nodes, per_node, intra_link, inter_link, device_rates("A100-80GB"), efficiency)


def _all_plans(cluster):
    return PLANS + list(hybrid_plans(cluster))


@given(st.integers(1, 8), st.sampled_from([1, 2, 8]), st.floats(1.01, 50), st.integers(1, 4),
       st.sampled_from(["none", "full"]))
def test_step_time_never_grows_with_inter_node_bandwidth(nodes, per_node, factor, accum, checkpointing):
    slow, fast = _cluster(nodes, per_node), _cluster(nodes, per_node, scale=factor)
    work = _workload(grad_accum=accum, checkpointing=checkpointing)
    for plan in _all_plans(slow):
        slow_t, fast_t = step_time(plan, work, slow), step_time(plan, work, fast)
        assert fast_t.step_s <= slow_t.step_s * (1 + 1e-12), plan
        assert fast_t.comm_s <= slow_t.comm_s * (1 + 1e-12), plan


@given(st.floats(0.05, 1.0), st.floats(0.0, 1.0))
def test_parts_add_up_and_efficiency_and_overlap_only_help(efficiency, overlap):
    cluster = _cluster(efficiency=efficiency, overlap=overlap)
    work = _workload()
    for plan in _all_plans(cluster):
        t = step_time(plan, work, cluster)
        assert 0 <= t.exposed_comm_s <= t.comm_s * (1 + 1e-12)
        assert t.step_s == pytest.approx(t.compute_s + t.optimizer_s + t.exposed_comm_s)
        assert t.tokens_per_s == pytest.approx(4096 * 32 / t.step_s)
        better = step_time(plan, work, _cluster(efficiency=min(1.0, efficiency * 1.5), overlap=overlap))
        assert better.step_s <= t.step_s
        hidden = step_time(plan, work, _cluster(efficiency=efficiency, overlap=min(1.0, overlap + 0.3)))
        assert hidden.exposed_comm_s <= t.exposed_comm_s * (1 + 1e-12)


def test_without_overlap_every_collective_is_on_the_critical_path():
    cluster = _cluster(overlap=0.0)
    for plan in _all_plans(cluster):
        t = step_time(plan, _workload(), cluster)
        assert t.exposed_comm_s == pytest.approx(t.comm_s)


def test_compute_follows_the_flop_formula():
    work = _workload(precision="fp32")
    cluster = _cluster(efficiency=1.0)
    t = step_time(PLANS[0], work, cluster)
    per_token = 6 * work.params + 12 * 40 * 5120 * 4096
    assert t.compute_s == pytest.approx(per_token * 4096 / 19.5e12)
    full = step_time(PLANS[0], _workload(precision="fp32", checkpointing="full"), cluster)
    assert full.compute_s == pytest.approx(t.compute_s * 4 / 3)


@given(st.integers(2, 8), st.sampled_from([2, 4, 8]), st.integers(1, 3))
def test_hybrid_bytes_per_link_follow_the_ring_model(nodes, per_node, accum):
    """Per buffer S (bf16, padded): in the group (k-1)/k S per reduce-scatter and per gather;
    across the G groups 2(G-1)/G S/k per all-reduce of the shard; plus, over every rank, the
    step's small agreement all-reduce (shardengine/step/agreement.py)."""
    cluster = _cluster(nodes, per_node)
    work = _workload(grad_accum=accum)
    k, groups = per_node, nodes
    padded = lambda numel: math.ceil(numel / k) * k  # noqa: E731
    for plan in hybrid_plans(cluster):
        t = step_time(plan, work, cluster)
        reductions = accum if plan.stage >= 2 else 1
        gathers = 2 * accum if plan.stage == 3 else 1
        buffers = [2 * padded(u) for u, _ in work.units] if plan.stage == 3 else \
            [2 * padded(b) for b in work.buckets]
        in_group = sum((k - 1) * s // k for s in buffers)
        across = sum(2 * (groups - 1) * (s // k) // groups for s in buffers)
        n = nodes * per_node
        sync = 2 * (n - 1) * vector_bytes(work.grad_tensors) // n
        assert t.ring_bytes("inter") == reductions * across + sync
        assert t.ring_bytes("intra") == (reductions + gathers) * in_group
    flat = step_time(TimedPlan("zero3", 3), work, cluster)
    hybrid = step_time(hybrid_plans(cluster)[2], work, cluster)
    assert hybrid.ring_bytes("inter") < flat.ring_bytes("inter")


def test_hybrid_sharding_beats_flat_stage_1_across_slow_nodes():
    cluster = _cluster(8, 8, inter="100gbe")
    times = {p.name: step_time(p, _workload(), cluster).step_s for p in _all_plans(cluster)}
    assert times["zero1-hsdp8"] < times["zero1"]


def test_a_ring_across_nodes_crosses_through_every_nic_of_the_node():
    """NCCL joins consecutive ranks spanning nodes as several rings, each crossing through
    another NIC: a rank's share crosses at gpus_per_node x one NIC (bounded by the
    intra-node link), while hybrid sharding's replica all-reduce (one rank per node) and
    all-to-all go through each rank's own NIC."""
    from memory_estimator.timing.collectives import collective_seconds
    from memory_estimator.timing.step import plan_collectives

    cluster = _cluster(8, 8, inter="100gbe")
    flat = plan_collectives(TimedPlan("zero3", 3), _workload(), cluster)
    gather = next(use for use in flat if use.collective == "all_gather" and use.link == "inter")
    nic = cluster.inter
    expected = sum(collective_seconds("all_gather", b, 64, nic.latency_s, nic.beta / 8) for b in gather.buffer_bytes)
    assert gather.seconds == pytest.approx(gather.per_step * expected)
    hybrid = plan_collectives(hybrid_plans(cluster)[2], _workload(), cluster)
    replica = next(use for use in hybrid if use.link == "inter" and use.collective == "all_reduce" and use.ranks == 8)
    own_nic = sum(collective_seconds("all_reduce", b, 8, nic.latency_s, nic.beta) for b in replica.buffer_bytes)
    assert replica.seconds == pytest.approx(replica.per_step * own_nic)


def test_one_node_has_no_inter_node_traffic_and_no_hybrid_plans():
    cluster = _cluster(1, 8)
    assert hybrid_plans(cluster) == ()
    for plan in PLANS:
        assert step_time(plan, _workload(), cluster).ring_bytes("inter") == 0
    with pytest.raises(EstimatorInputError, match="must divide"):
        hybrid_plans(_cluster(2, 8), group_size=3)


def test_gloo_links_price_the_in_place_forms():
    """On a Gloo link the reduce-scatter costs an all-reduce, as the engine issues it."""
    gloo = Link("loopback", 1e9, 1e-4, efficiency=1.0, backend="gloo")
    cluster = Cluster(1, 2, gloo, gloo, device_rates("A100-80GB"))
    work = Workload(1_000_000, 256, buckets=(1_000_000,), precision="fp32")
    (reduce, gather, _sync) = plan_collectives(TimedPlan("zero1", 1), work, cluster)
    (all_reduce, _sync) = plan_collectives(TimedPlan("ddp", 0), work, cluster)
    assert reduce.seconds == pytest.approx(all_reduce.seconds) and reduce.ring_bytes == all_reduce.ring_bytes
    assert gather.ring_bytes == 2_000_000


def test_the_disk_tier_adds_its_read_and_write_at_the_drive_rate():
    """Each step reads the fp32 master and Adam's two moments (4 + 8 bytes per stepped element)
    from the node's drive and writes them back, the drive shared by the node's ranks."""
    workload, cluster = _workload(), _cluster()
    host = optimizer_seconds(workload, TimedPlan("zero3-offload", 3, offload=True), cluster)
    disk = optimizer_seconds(workload, TimedPlan("zero3-offload", 3, offload=True, disk=True), cluster)
    stepped = math.ceil(workload.params / cluster.world_size)
    assert disk - host == pytest.approx(stepped * 2 * (4 + 8) / (DISK_BYTES_PER_S / 8))


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_parameters_on_the_host_cross_the_host_link_at_each_gather(grad_accum):
    """zero3-offload-params: each unit's fp32 shard goes up before its forward and its backward
    gather, its reduced gradient shard comes down, every micro-step, over PCIe; the step's own
    round trip is gone (the shards already crossed) and the ranks exchange exactly the same bytes."""
    workload, cluster = _workload(grad_accum=grad_accum), _cluster()
    optimizer_only = TimedPlan("zero3-offload", 3, offload=True)
    params_too = TimedPlan("zero3-offload-params", 3, offload=True, params_on_host=True)
    base, host = step_time(optimizer_only, workload, cluster), step_time(params_too, workload, cluster)
    copies = [u for u in host.collectives if u.link == "host"]
    pcie = resolve_link(cluster.device.host_link).bandwidth_bytes_per_s
    shard = workload.all_units[0][0] // cluster.world_size
    up = [u for u in copies if u.collective == "host_to_device"]
    down = [u for u in copies if u.collective == "device_to_host"]
    assert [u.phase for u in up] == ["forward", "backward"] and [u.phase for u in down] == ["backward"]
    assert sum(u.seconds for u in up) == pytest.approx(grad_accum * 2 * 40 * 4 * shard / pcie)
    assert down[0].seconds == pytest.approx(grad_accum * 40 * 2 * shard / pcie)  # bf16 gradients
    assert sum(u.ring_bytes for u in host.collectives) == sum(u.ring_bytes for u in base.collectives)
    stepped = math.ceil(workload.params / cluster.world_size)
    assert base.optimizer_s - host.optimizer_s == pytest.approx(stepped * 2 * 2 / pcie)
    assert host.exposed_comm_s >= base.exposed_comm_s


def test_a_fractional_offload_copies_and_steps_only_its_units_on_the_host():
    """shardengine's zero3-offload-params-0.25 on 40 equal units: the 10 units gathered first
    in forward (the rest stay resident) cross PCIe, a quarter of all units' copies; a quarter of
    the step runs on the host, the rest on the device; the ranks exchange zero3's bytes."""
    workload, cluster = _workload(grad_accum=2), _cluster()
    resident, everything = TimedPlan("zero3", 3), TimedPlan("zero3-offload-params", 3, offload=True, params_on_host=True)
    quarter = TimedPlan("zero3-offload-params-0.25", 3, params_on_host=True, host_share=0.25)
    times = {plan.name: step_time(plan, workload, cluster) for plan in (resident, quarter, everything)}

    def copied(name: str) -> tuple[float, ...]:
        return tuple(sum(u.seconds for u in times[name].collectives if u.collective == kind)
                     for kind in ("host_to_device", "device_to_host"))

    assert copied("zero3-offload-params-0.25") == pytest.approx(tuple(0.25 * s for s in copied("zero3-offload-params")))
    assert copied("zero3") == (0, 0)
    on_device, on_host = (optimizer_seconds(workload, plan, cluster) for plan in (resident, everything))
    assert times["zero3-offload-params-0.25"].optimizer_s == pytest.approx(0.75 * on_device + 0.25 * on_host)
    assert sum(u.ring_bytes for u in times["zero3-offload-params-0.25"].collectives) == \
        sum(u.ring_bytes for u in times["zero3"].collectives)
    steps = [times[name].step_s for name in ("zero3", "zero3-offload-params-0.25", "zero3-offload-params")]
    assert steps == sorted(steps)


def test_parameters_on_disk_are_read_from_the_drive_before_each_gather():
    """zero3-offload-params-disk: beside the host link's copies, each unit's fp32 shard is read from
    the node's drive (shared by its ranks) before its forward and its backward gather, in the same
    windows; the step reads and writes the master and state as the optimizer's disk tier does."""
    workload, cluster = _workload(), _cluster()
    host = step_time(TimedPlan("zero3-offload-params", 3, offload=True, params_on_host=True), workload, cluster)
    disk = step_time(TimedPlan("zero3-offload-params-disk", 3, offload=True, params_on_host=True, disk=True),
                     workload, cluster)
    reads = [u for u in disk.collectives if u.collective == "disk_read"]
    shard = workload.all_units[0][0] // cluster.world_size
    assert [u.phase for u in reads] == ["forward", "backward"]
    assert sum(u.seconds for u in reads) == pytest.approx(2 * 40 * 4 * shard / (DISK_BYTES_PER_S / 8))
    assert [u for u in disk.collectives if u.collective != "disk_read"] == list(host.collectives)
    stepped = math.ceil(workload.params / cluster.world_size)
    assert disk.optimizer_s - host.optimizer_s == pytest.approx(stepped * 2 * (4 + 8) / (DISK_BYTES_PER_S / 8))
    assert disk.step_s > host.step_s
