"""Three ranks train at stage 3; rank 2 is SIGKILLed while the others wait in its collectives.

    python tests/engine/dead_peer_cases.py OUT_DIR

Rank 2 writes the time of its death to ``OUT_DIR/killed`` and kills itself half a second
into step 2 (before issuing its collectives); ranks 0 and 1 write when their
``CollectiveError`` came and what it said to ``OUT_DIR/rank_<r>.json``. The collective
timeout is 300 s: an error within seconds is the sockets closing (and the reason the first
survivor leaves in the store, distributed/channel.py), not the timeout. Its own processes
(forked here), because the test's rank pool does not survive a killed worker.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import shardengine as se  # before any group exists, as a training script imports it
from toy_models import build_model

WORLD = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    net = build_model(dict(vocab=11, dim=7, hidden=[5, 3], buffer=False))
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=3, timeout_s=300.0)
    ids, targets = torch.randint(11, (3, 4)), torch.randint(11, (3, 4))

    def step() -> None:
        F.cross_entropy(model(ids).reshape(-1, 11), targets.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    if rank == WORLD - 1:
        time.sleep(0.5)
        with open(os.path.join(out, "killed"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    result = {"error": None}
    try:
        step()
    except se.CollectiveError as error:
        result = {"error": str(error)}
    result["noticed_at"] = time.time()
    with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the group lost a rank: leave without tearing it down (it would wait for the dead one)


def main(out: str) -> None:
    context = mp.get_context("fork")  # the ranks start with torch and shardengine already imported
    port = _free_port()
    ranks = [context.Process(target=rank_main, args=(rank, port, out)) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=200)
    codes = [process.exitcode for process in ranks]
    if codes[:2] != [0, 0] or codes[2] != -signal.SIGKILL:
        sys.exit(f"unexpected exit codes {codes}")


if __name__ == "__main__":
    main(sys.argv[1])
