"""A real TCPStore server and N simulated ranks, each with a connection of its own.

[Note: how the simulation models N ranks on a few cores]
The server is torch's ``TCPStore`` (libuv backend, as torchrun's), in the
parent process. The N ranks are N client ``TCPStore`` objects (one TCP
connection each, as each rank of a job has), spread over ``processes`` worker
processes of ``threads`` threads; a thread drives its ranks one after another.
Phases run as *bursts*: every rank starts together (barriers across threads and
processes), as ranks do at a step boundary, and a burst's time is from its start
until the last rank's last request was answered. That is what a lock-step job
loses: no rank gets past the next collective before the slowest. With more
ranks than threads, a burst keeps up to ``processes x threads`` requests in
flight, enough to keep the one server thread busy, so the burst measures the
server's throughput under the same total load; it does not model network
latency (loopback here) or a server with cores of its own (here it shares the
2 cores with the clients).
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from control_plane_replay import Request, rank_script

TIMEOUT = datetime.timedelta(seconds=600)
CONNECT_THREADS = 256  # per worker process


@dataclass
class Burst:
    """One burst: when it started and ended (monotonic, shared by processes), requests, latencies."""

    start: float
    end: float
    requests: int
    latencies: list[float] = field(default_factory=list)


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT, wait_for_workers=False)


def _send(store, request: Request) -> Any:
    op, key = request.op, request.key
    if op == "set":
        return store.set(key, b"x" * max(request.amount, 1))
    if op == "add":
        return store.add(key, request.amount)
    if op == "get":
        return store.get(key)
    if op == "check":
        return store.check([key])
    if op == "wait":
        return store.wait([key])
    if op == "compare_set":
        return store.compare_set(key, "", b"x" * max(request.amount, 1))
    if op == "multi_get":
        return store.multi_get([key])
    raise ValueError(f"no replay for {op}")


# --------------------------------------------------------------------------- what a rank does per stage

def _announce_after(rank: int, world: int, number: int, space: str, stage: int) -> list[Request]:
    """step/call_agreement.py's announce: stage 0 arrives, stage 1 waits (the last one's ``set``
    of the done key is added where the ``add`` returns number*world, see _run_stage)."""
    call = f"{space}/calls/{number}"
    if stage == 0:
        return [Request("set", f"{space}/calls/rank{rank}", 20), Request("compare_set", f"{call}/name", 21),
                Request("add", f"{space}/word", 1)]
    return [Request("wait", f"{call}/done", 0), Request("multi_get", f"{call}/done", 0)]


def _announce_before(rank: int, world: int, number: int, space: str, stage: int) -> list[Request]:
    """The protocol before issue 43: name and position, then one round over every other rank
    (its position, whether it named the call, the name): all have arrived by then."""
    if stage == 0:
        return [Request("set", f"{space}/calls/{number}/rank{rank}", 18),
                Request("add", f"{space}/calls/position/rank{rank}", 1)]
    return [request for other in range(world) if other != rank for request in (
        Request("add", f"{space}/calls/position/rank{other}", 0),
        Request("check", f"{space}/calls/{number}/rank{other}", 0),
        Request("get", f"{space}/calls/{number}/rank{other}", 0))]


def _requests(task: dict, rank: int, world: int, stage: int) -> list[Request]:
    kind = task["kind"]
    if kind == "script":
        return rank_script(task["stages"][stage], rank, world, task["space"])
    if kind == "poll":
        return rank_script([task["request"]], rank, world, task["space"])
    protocol = _announce_after if kind == "announce_after" else _announce_before
    return protocol(rank, world, task["number"], task["space"], stage)


def stage_count(task: dict) -> int:
    return len(task["stages"]) if task["kind"] == "script" else 1 if task["kind"] == "poll" else 2


# --------------------------------------------------------------------------- worker processes

def _worker(port: int, ranks: list[int], world: int, threads: int, inbox, outbox, barrier) -> None:
    clients: dict[int, Any] = {}
    lock = threading.Lock()
    shares = [ranks[t::threads] for t in range(threads)]

    def connect(share: list[int]) -> None:
        made = {rank: _client(port) for rank in share}
        with lock:
            clients.update(made)

    # A connection waits ~0.2 s for the server here (loopback, not CPU): connect many at once.
    connecting = min(len(ranks), CONNECT_THREADS)
    _in_threads(connecting, lambda t: connect(ranks[t::connecting]))
    outbox.put(("ready", len(clients)))
    while True:
        task = inbox.get()
        if task is None:
            return
        results = [_run_stage(task, stage, shares, clients, world, threads, barrier)
                   for stage in range(stage_count(task))]
        outbox.put(("done", results))


def _run_stage(task: dict, stage: int, shares, clients, world: int, threads: int, barrier) -> Burst:
    latencies: list[list[float]] = [[] for _ in range(threads)]
    ends = [0.0] * threads
    gate = threading.Barrier(threads, action=barrier.wait)  # every thread of every process, then go
    start = [0.0]

    def run(t: int) -> None:
        gate.wait()
        if t == 0:
            start[0] = time.monotonic()
        for rank in shares[t]:
            for request in _requests(task, rank, world, stage):
                began = time.perf_counter()
                answer = _send(clients[rank], request)
                latencies[t].append(time.perf_counter() - began)
                if last_to_arrive(task, request, answer, world):
                    _send(clients[rank], Request("set", f"{task['space']}/calls/{task['number']}/done", 4))
                    latencies[t].append(0.0)  # counted as a request; its time is in the burst's
        ends[t] = time.monotonic()

    _in_threads(threads, run)
    flat = [value for per_thread in latencies for value in per_thread]
    return Burst(start[0], max(ends), len(flat), flat)


def last_to_arrive(task: dict, request: Request, answer: Any, world: int) -> bool:
    """The announcing rank whose ``add`` to the word made it number*world sets the done key."""
    return (task["kind"] == "announce_after" and request.op == "add" and request.key.endswith("/word")
            and answer == task["number"] * world)


def _in_threads(threads: int, body) -> None:
    running = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()


# --------------------------------------------------------------------------- the parent

class Cluster:
    """The server here and ``world`` simulated ranks in worker processes (see the Note)."""

    def __init__(self, world: int, processes: int, threads: int) -> None:
        context = mp.get_context("spawn")  # a fork would copy the server's libuv thread's state
        self.server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
        self.world, self.processes = world, processes
        barrier = context.Barrier(processes)
        self.inboxes = [context.Queue() for _ in range(processes)]
        self.outbox = context.Queue()
        started = time.monotonic()
        self.workers = [context.Process(target=_worker, args=(
            self.server.port, list(range(p, world, processes)), world, min(threads, max(1, world // processes)),
            self.inboxes[p], self.outbox, barrier), daemon=True) for p in range(processes)]
        for worker in self.workers:
            worker.start()
        connected = sum(self.outbox.get(timeout=1800)[1] for _ in self.workers)
        if connected != world:
            raise RuntimeError(f"{connected} of {world} ranks connected")
        self.connect_s = time.monotonic() - started  # includes the worker processes' start-up

    def run(self, task: dict) -> list[Burst]:
        """One burst per stage of ``task``, every rank taking part."""
        for inbox in self.inboxes:
            inbox.put(task)
        replies = [self.outbox.get(timeout=3600)[1] for _ in self.workers]
        merged = []
        for stage in range(stage_count(task)):
            parts = [reply[stage] for reply in replies]
            merged.append(Burst(min(p.start for p in parts), max(p.end for p in parts),
                                sum(p.requests for p in parts), [v for p in parts for v in p.latencies]))
        return merged

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for worker in self.workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
