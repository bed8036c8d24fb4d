"""Two torchrun agents on this machine as two "nodes" (2 ranks each, c10d rendezvous, Gloo).

One run checks both things a multi-node user relies on:

* stage 3 across the two agents trains exactly like a single process on the global
  batches (``multinode_train.reference_state``; relative error <= 2e-4 per tensor),
  sharded over all 4 ranks and, in the same launch, with hybrid sharding
  (``shard_group_size="node"``: a shard group per node, k = 2), whose only traffic
  between the nodes is then the all-reduce of reduced shards and the step's agreement;
* when one node dies (its agent and its workers SIGKILLed, as when a machine goes
  down), the other node's ranks raise ``se.CollectiveError`` within the engine's
  ``timeout_s`` instead of hanging, and its agent exits with an error.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import torch

import multinode_train
from engine_cases import rel_err
from rank_pool import scripts_pythonpath  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))  # this test's folder: its case scripts
ENGINE_TIMEOUT_S = 20.0  # generous under load; a dead node drops its links at once anyway
STEPS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _agent(node_rank: int, port: int, run_id: str, args: list[str], log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
               "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id={run_id}", "--max-restarts=0", "--monitor-interval=0.2",
               os.path.join(HERE, "multinode_train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": scripts_pythonpath(os.environ.get("PYTHONPATH", ""))}
    log = open(log_path, "w")
    # Its own session: killing "the node" must not reach pytest.
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL the agent and every worker it started (they run in sessions of their own)."""
    processes = [psutil.Process(agent.pid)] + psutil.Process(agent.pid).children(recursive=True)
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    agent.wait(timeout=10)


def _wait_listening(port: int, agent: subprocess.Popen, log: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and agent.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    _kill_node(agent)
    raise AssertionError("node 0's agent never listened on the rendezvous port:\n" + open(log).read()[-3000:])


def _wait_for(path: str, agents: list[subprocess.Popen], logs: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        finished = [a for a in agents if a.poll() is not None]
        if finished or time.monotonic() > deadline:
            for agent in agents:
                if agent.poll() is None:
                    _kill_node(agent)
            tails = "\n".join(open(log).read()[-3000:] for log in logs)
            raise AssertionError(f"training did not reach {path} (agent exited: {bool(finished)}):\n{tails}")
        time.sleep(0.1)


def test_two_agents_train_like_one_process_and_a_dead_node_is_a_clear_error(tmp_path):
    port, out, marker = _free_port(), str(tmp_path / "final.pt"), str(tmp_path / "trained")
    args = ["--stage", "3", "--steps", str(STEPS), "--timeout-s", str(ENGINE_TIMEOUT_S), "--out", out,
            "--marker", marker, "--keep-training", "--shard-group-size", "all", "--shard-group-size", "node"]
    logs = [str(tmp_path / f"node{rank}.log") for rank in (0, 1)]
    started = time.monotonic()
    # Node 0 first, and node 1 once node 0's agent listens: node 0 hosts the rendezvous store,
    # as the --rdzv-endpoint node does on a cluster (so killing node 1 leaves the store up).
    agents = [_agent(0, port, f"multinode-{port}", args, logs[0])]
    _wait_listening(port, agents[0], logs[0])
    agents.append(_agent(1, port, f"multinode-{port}", args, logs[1]))
    _wait_for(marker, agents, logs, timeout_s=180)  # two models trained; generous under load
    trained_s = time.monotonic() - started

    # Equivalence: 4 ranks over two agents == one process on the global batches, plain and hybrid.
    reference = multinode_train.reference_state(STEPS, world=4)
    errors = {}
    for group_size, k in (("all", 4), ("node", 2)):
        path = multinode_train.output_path(out, group_size)
        final = torch.load(path, weights_only=True)
        assert sorted(final) == sorted(reference)
        errors[group_size] = max(rel_err(final[key], reference[key]) for key in reference)
        sent = json.load(open(path + ".bytes.json"))
        assert sent["shard_group_size"] == k, sent
        by_group, model = sent["by_group"], sent["ring_model_by_group"]
        # The counters follow the ring model per group; the clipping norm (one fp32 scalar,
        # all-reduced in the shard group) is the only collective outside the model.
        assert by_group["intra_group"] == model["intra_group"] + 2 * (k - 1) * 4 // k, sent
        assert by_group["inter_group"] == model["inter_group"] and by_group["all_ranks"] == model["all_ranks"]
        assert (by_group["inter_group"] > 0) == (k == 2), sent
    assert all(error <= 2e-4 for error in errors.values()), errors

    # Node 1 goes down mid-training; node 0's ranks must say so within the timeout.
    killed_at = time.time()
    _kill_node(agents[1])
    try:
        code = agents[0].wait(timeout=ENGINE_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        _kill_node(agents[0])
        raise AssertionError("node 0 hung after node 1 died:\n" + open(logs[0]).read()[-3000:])
    log = open(logs[0]).read()
    failures = re.findall(r"COLLECTIVE_ERROR (\d+\.\d+) CollectiveError: (.*?)(?=COLLECTIVE_ERROR|\n|$)", log)
    assert len(failures) == 2, log[-4000:]   # both of node 0's ranks
    for when, message in failures:
        assert float(when) - killed_at <= ENGINE_TIMEOUT_S + 2, (float(when) - killed_at, message)
        assert "peer rank may have crashed" in message and f"timeout is {ENGINE_TIMEOUT_S:.0f}s" in message
    assert code != 0, "node 0's agent must report its failed workers"
    detected = max(float(when) for when, _ in failures) - killed_at
    assert "RendezvousConnectionError" not in log, "node 0 lost its own rendezvous store"
    print(f"two agents x 2 ranks: stage 3 plain and hybrid trained {STEPS} steps each in {trained_s:.1f} s, "
          f"max rel err {errors}; hybrid's last step sent {sent['by_group']} bytes per group; node 1 killed, node 0 raised CollectiveError after {detected:.2f} s, "
          f"its agent exited {time.time() - killed_at:.1f} s after the kill")
