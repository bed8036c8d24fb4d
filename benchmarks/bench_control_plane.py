"""The control plane at 256-8,192 ranks: what the engine sends to the rendezvous store, replayed.

    python benchmarks/bench_control_plane.py                       # the table (connecting alone: ~25 min, 2 cores)
    python benchmarks/bench_control_plane.py --ranks 256,1024      # a quicker one
    python benchmarks/bench_control_plane.py --record after        # re-record this tree's protocol

What each rank sends comes from real runs recorded with a wrapped store
(``control_plane_record.py`` under torchrun, N = 2 and 3, stages 0-3; the folders
``control_plane_traces/before`` (the protocol before issue 43, commit 4625ad5) and
``control_plane_traces/after``). ``control_plane_replay.py`` turns them into one script
per phase, checked to be the same at N = 2 and 3 but for the world size; announced
calls are replayed by each protocol's logic, checked against the recordings. Then
``control_plane_sim.py`` plays them against one real TCPStore with N client
connections (its Note says how N ranks share a few cores) and reports, per protocol:

* a training step: store requests per rank, the time a lock-step step loses to them
  (p50, p99 over steps), and the store's request rate while they arrive;
* one announced call (``state_dict()`` & co) and a checkpoint (save + load);
* a stalled wait: every rank reads the store once per 0.5 s slice (the abort poll);
  the time an answer takes is what noticing a stopped peer costs beyond the slice;
* start-up: the engine's own keys, and Gloo's rendezvous of each group (torch's:
  every rank reads every address, 2N+1 requests per rank per group).

Work growing as N^2 (the old announcement, Gloo's rendezvous) is run up to
``--quadratic-limit`` requests and otherwise extrapolated from the rate measured at
the largest N that ran (marked "est."). Results: the table on stdout and
``benchmarks/results/bench_control_plane.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import control_plane_replay as replay  # noqa: E402
from launch import torchrun  # noqa: E402
from shardengine.distributed.channel import poll_interval_s  # noqa: E402

TRACES = os.path.join(HERE, "control_plane_traces")
STAGES_SHOWN = (0, 1, 3)  # stage 2 sends what stage 1 does (recorded)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _burst_s(burst) -> float:
    return burst.end - burst.start


def measure_steps(cluster, script: list, steps: int, space: str) -> dict:
    """Each of a step's requests is a burst over all ranks; the step loses their sum."""
    if not script:
        return {"requests_per_rank": 0, "p50_ms": 0.0, "p99_ms": 0.0, "rate": 0.0}
    per_step, total, busy = [], 0, 0.0
    for _ in range(steps):
        bursts = cluster.run({"kind": "script", "stages": [[request] for request in script], "space": space})
        per_step.append(sum(_burst_s(b) for b in bursts))
        total += sum(b.requests for b in bursts)
        busy += per_step[-1]
    return {"requests_per_rank": len(script), "p50_ms": 1e3 * _p(per_step, 0.5),
            "p99_ms": 1e3 * _p(per_step, 0.99), "rate": total / busy}


def measure_announce(cluster, kind: str, calls: int, space: str, world: int) -> dict:
    times, total = [], 0
    for number in range(1, calls + 1):
        bursts = cluster.run({"kind": kind, "number": number, "space": space})
        times.append(sum(_burst_s(b) for b in bursts))
        total += sum(b.requests for b in bursts)
    return {"requests_per_rank": total / calls / world, "p50_ms": 1e3 * _p(times, 0.5),
            "p99_ms": 1e3 * _p(times, 0.99), "rate": total / sum(times)}


def measure_polls(cluster, request, slices: int, space: str, interval_s: float) -> dict:
    """Every rank reads the store once per slice, all at once (they stalled together)."""
    latencies, bursts = [], []
    for _ in range(slices):
        began = time.monotonic()
        burst = cluster.run({"kind": "poll", "request": request, "space": space})[0]
        latencies += burst.latencies
        bursts.append(_burst_s(burst))
        time.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    return {"interval_s": interval_s, "answer_p50_ms": 1e3 * _p(latencies, 0.5),
            "answer_p99_ms": 1e3 * _p(latencies, 0.99), "last_answer_ms": 1e3 * max(bursts),
            "rate": cluster.world / interval_s}


def measure_startup(cluster, script: list, space: str, limit: int) -> dict:
    """Gloo's rendezvous of one group and the engine's keys; stages: writes, then reads."""
    writes = [item for item in script if not isinstance(item, replay.Loop)]
    reads = [item for item in script if isinstance(item, replay.Loop)]
    world = cluster.world
    per_rank = len(writes) + sum(len(loop.body) for loop in reads) * world
    found = {"requests_per_rank": per_rank, "engine_requests_per_rank": sum("shardengine" in r.key for r in writes)}
    if per_rank * world > limit:
        return found
    bursts = cluster.run({"kind": "script", "stages": [writes, reads], "space": space})
    seconds = sum(_burst_s(b) for b in bursts)
    return {**found, "seconds": seconds, "rate": sum(b.requests for b in bursts) / seconds}


def simulate(world: int, traces: dict, args) -> dict:
    from control_plane_sim import Cluster  # noqa: PLC0415 - spawns processes; --help must not need them

    cluster = Cluster(world, args.processes, args.threads)
    found = {"connect_s": cluster.connect_s}
    try:
        for protocol in ("before", "after"):
            recorded, space = traces[protocol], f"{protocol}/N{world}"
            row = {"steps": {stage: measure_steps(cluster, replay.per_step(replay.scripts(
                recorded, f"s{stage}/step"), 3), args.steps, space) for stage in STAGES_SHOWN}}
            kind = "announce_after" if protocol == "after" else "announce_before"
            quadratic = protocol == "before" and 3 * world * world > args.quadratic_limit
            row["announce"] = {"requests_per_rank": 3 * (world - 1) + 2} if quadratic else \
                measure_announce(cluster, kind, args.calls, space, world)
            per_checkpoint = 2 if replay.checkpoint_announced(recorded) else 0
            row["checkpoint_requests_per_rank"] = per_checkpoint * row["announce"]["requests_per_rank"]
            # the slice: 0.5 s before; after, the engine's own rule (distributed/channel.py)
            interval = poll_interval_s(world) if protocol == "after" else 0.5
            row["stalled"] = measure_polls(cluster, replay.poll_request(recorded, 3), args.slices, space, interval)
            row["startup"] = {"init_process_group": measure_startup(
                cluster, replay.scripts(recorded, "init_process_group"), space + "/init", args.quadratic_limit),
                "shard": measure_startup(cluster, replay.scripts(recorded, "s3/shard"), space + "/shard",
                                         args.quadratic_limit)}
            found[protocol] = row
    finally:
        cluster.close()
    return found


def extrapolate(results: dict) -> None:
    """Fill the quadratic rows that did not run from the rate at the largest N that ran."""
    for protocol in ("before", "after"):
        ran = [n for n in results if "p50_ms" in results[n][protocol]["announce"]]
        for world, row in results.items():
            announce = row[protocol]["announce"]
            if "p50_ms" not in announce and ran:
                rate = results[max(ran)][protocol]["announce"]["rate"]
                announce["estimated_ms"] = 1e3 * announce["requests_per_rank"] * world / rate
            for part in row[protocol]["startup"].values():
                done = [n for n in results if "rate" in results[n][protocol]["startup"]["shard"]]
                if "seconds" not in part and done:
                    rate = results[max(done)][protocol]["startup"]["shard"]["rate"]
                    part["estimated_s"] = part["requests_per_rank"] * world / rate


def print_table(results: dict) -> None:
    print("\nA training step: store requests per rank, time lost per step (p50 / p99), store rate")
    print(f"{'N':>6} {'stage':>5} | {'before':>36} | {'after':>14}")
    for world, row in results.items():
        for stage in STAGES_SHOWN:
            b, a = row["before"]["steps"][stage], row["after"]["steps"][stage]
            print(f"{world:>6} {stage:>5} | {b['requests_per_rank']} req, {b['p50_ms']:7.1f} / {b['p99_ms']:7.1f} ms, "
                  f"{b['rate']:7.0f}/s | {a['requests_per_rank']} req, {a['p50_ms']:.1f} ms")
    print("\nOne announced call (state_dict() & co): requests per rank, time (p50 / p99); a checkpoint")
    for world, row in results.items():
        cells = []
        for protocol in ("before", "after"):
            c = row[protocol]["announce"]
            timing = (f"{c['p50_ms']:8.1f} / {c['p99_ms']:8.1f} ms" if "p50_ms" in c
                      else f"est. {c.get('estimated_ms', float('nan')):8.0f} ms     ")
            cells.append(f"{c['requests_per_rank']:7.0f} req, {timing}, ckpt {row[protocol]['checkpoint_requests_per_rank']:.0f} req")
        print(f"{world:>6} | before {cells[0]} | after {cells[1]}")
    print("\nA stalled wait: one read per rank per slice; slice, answer p50 / p99, last rank's answer, store rate")
    for world, row in results.items():
        cells = [f"{s['interval_s']:.1f} s, {s['answer_p50_ms']:.2f} / {s['answer_p99_ms']:.2f} ms, last "
                 f"{s['last_answer_ms']:.0f} ms, {s['rate']:.0f}/s" for s in (row["before"]["stalled"], row["after"]["stalled"])]
        print(f"{world:>6} | before {cells[0]} | after {cells[1]}")
    print("\nStart-up per group (Gloo's rendezvous, torch's) and the engine's own keys; connecting N clients")
    for world, row in results.items():
        part = row["after"]["startup"]["shard"]
        took = f"{part['seconds']:.1f} s" if "seconds" in part else f"est. {part.get('estimated_s', float('nan')):.0f} s"
        engine = {p: row[p]["startup"]["shard"]["engine_requests_per_rank"] for p in ("before", "after")}
        print(f"{world:>6} | {part['requests_per_rank']} req/rank per group, {took} | engine keys per rank "
              f"{engine} | connecting the simulated ranks took {row['connect_s']:.1f} s")


def record(protocol: str) -> None:
    folder = os.path.join(TRACES, protocol)
    os.makedirs(folder, exist_ok=True)
    script = os.path.join(HERE, "control_plane_record.py")
    for world, extra in ((2, []), (3, []), (4, ["--stages", "3", "--hybrid", "2"])):
        torchrun(script, world, ["--out", folder, *extra], check=True, echo=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="256,1024,4096,8192")
    parser.add_argument("--processes", type=int, default=4, help="worker processes for the simulated ranks")
    parser.add_argument("--threads", type=int, default=32, help="threads per worker process")
    parser.add_argument("--steps", type=int, default=10, help="training steps per stage and protocol")
    parser.add_argument("--calls", type=int, default=5, help="announced calls per protocol")
    parser.add_argument("--slices", type=int, default=6, help="0.5 s slices of the stalled wait")
    parser.add_argument("--quadratic-limit", type=int, default=400_000,
                        help="run O(N^2) phases only up to this many requests; extrapolate above")
    parser.add_argument("--record", choices=["after"], help="record this tree's protocol first (torchrun, N=2,3,4)")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "bench_control_plane.json"))
    args = parser.parse_args()
    if args.record:
        record(args.record)
    traces = {protocol: replay.load_traces(os.path.join(TRACES, protocol)) for protocol in ("before", "after")}
    problems = replay.check_announce_models(traces["before"], traces["after"])
    if problems:
        sys.exit("the replayed announcements differ from the recordings:\n" + "\n".join(problems))
    results = {}
    for world in (int(n) for n in args.ranks.split(",")):
        started = time.monotonic()
        results[world] = simulate(world, traces, args)
        print(f"N={world}: simulated in {time.monotonic() - started:.0f} s", flush=True)
    extrapolate(results)
    print_table(results)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
