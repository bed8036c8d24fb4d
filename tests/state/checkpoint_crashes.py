"""Kill a rank at each named point of a checkpoint save; ``latest`` must always load, bit-exact.

Run as a script by ``test_checkpoint_crashes.py`` (one process: torch is
imported once). Each trial forks a fresh 2-rank Gloo group (a FileStore per
trial), so a trial costs a fork and a rendezvous, not two interpreter
start-ups. In a trial both ranks train a step and save checkpoint A (no
fault), train another step and save B, either the same step again (the
re-save of the step ``latest`` names, as after a resume) or the next one; one
rank SIGKILLs itself at the k-th named point of B's save
(``shardengine.state.checkpoint.writing.on_point``) and the parent at once kills
the other, as torchrun would. Then, with no process group, the parent loads
``latest`` into a fresh model: it must load, hold A or B (at most the
in-flight checkpoint is lost), and equal, bit for bit, the parameters and
buffers that rank 0 recorded before that save began.

A first trial without a kill lists the points of each kind of save; every
point of a re-save is then tried, plus seeded random points of the other kinds.
Prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

import checkpoint_cases as cases
import shardengine as se
import shardengine.state.checkpoint.writing as writing
from shardengine.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from shardengine.state.checkpoint.format import OLD_PREFIX, PREVIOUS_SUFFIX, TMP_PREFIX

WORLD = 2
NO_KILL = 10**9


# --------------------------------------------------------------------------- in the forked ranks


def _arm(kill_rank: int, kill_at: int, rank: int, points: list[str]) -> None:
    def on_point(name: str) -> None:
        points.append(name)
        if rank == kill_rank and len(points) - 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    writing.on_point = on_point


def _save_recorded(work: str, model, optimizer, step: int, trial_id: int) -> None:
    """Record the full state (rank 0), then save it with ``extra={"step", "trial"}``."""
    full = model.full_state_dict(rank0_only=True)
    if dist.get_rank() == 0:
        expected = os.path.join(work, f"expected_{trial_id}.pt")
        torch.save(full, expected + ".tmp")
        os.replace(expected + ".tmp", expected)
    save_checkpoint(os.path.join(work, "ckpt"), model, optimizer, extra={"step": step, "trial": trial_id}, keep=2)


def _leftovers(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root)
                  if name.startswith((TMP_PREFIX, OLD_PREFIX)) or name.endswith((PREVIOUS_SUFFIX, ".tmp")))


def rank_main(work: str, trial: dict, rank: int) -> None:
    """One rank of one trial; never returns (``os._exit``)."""
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{work}/store_{trial['index']}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=30))
        torch.manual_seed(1000 * trial["index"] + rank)
        model, optimizer = cases.build(trial["stage"])
        cases.train(model, optimizer, 1)
        _save_recorded(work, model, optimizer, trial["step_a"], 2 * trial["index"])
        if rank == 0:
            with open(os.path.join(work, f"leftovers_{trial['index']}.json"), "w") as f:
                json.dump(_leftovers(os.path.join(work, "ckpt")), f)
        cases.train(model, optimizer, 1)
        points: list[str] = []
        _arm(trial["kill_rank"], trial["kill_at"], rank, points)
        _save_recorded(work, model, optimizer, trial["step_b"], 2 * trial["index"] + 1)
        with open(os.path.join(work, f"points_{trial['index']}_{rank}.json"), "w") as f:
            json.dump(points, f)
    except BaseException as error:  # noqa: BLE001 - a peer's death surfaces here: report and exit
        print(f"rank {rank}: {type(error).__name__}: {str(error)[:300]}", file=sys.stderr, flush=True)
        code = 3
    os._exit(code)


# --------------------------------------------------------------------------- in the parent


def run_trial(work: str, trial: dict) -> dict[int, int]:
    """Fork the ranks; when one is killed, kill the other at once. Returns rank -> wait status."""
    pids = {}
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            rank_main(work, trial, rank)
        pids[pid] = rank
    statuses: dict[int, int] = {}
    while pids:
        pid, status = os.waitpid(-1, 0)
        statuses[pids.pop(pid)] = status
        if os.WIFSIGNALED(status):
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return statuses


def check_latest(work: str, allowed: tuple[int, ...]) -> int:
    """Load ``latest`` with no process group; returns the trial id it holds, or raises."""
    model, optimizer = cases.build(0)
    extra = load_checkpoint(os.path.join(work, "ckpt"), model, optimizer)
    held = extra["trial"]
    if held not in allowed:
        raise AssertionError(f"latest holds trial {held}, expected one of {allowed}")
    expected = torch.load(os.path.join(work, f"expected_{held}.pt"), weights_only=True)
    if not cases.same(model.full_state_dict(), expected):
        raise AssertionError(f"latest (trial {held}) loads, but not bit-exact")
    return held


def _warm_up(scratch: str) -> None:
    """Import now what the first optimizer step and save import (torch._dynamo takes seconds),
    so every forked trial inherits it."""
    model, optimizer = cases.build(1)
    cases.train(model, optimizer, 1)
    save_checkpoint(scratch, model, optimizer)
    load_checkpoint(scratch, model, optimizer)


def plan(seed: int, resave_points: int, new_points: int, rank1_points: int, extra_random: int) -> list[dict]:
    """Every point of a re-save on rank 0, then seeded random points of the other kinds."""
    rng = random.Random(seed)
    kinds = [("resave", 0, k) for k in range(resave_points)]
    kinds += [("new", 0, rng.randrange(new_points)) for _ in range(extra_random)]
    kinds += [(rng.choice(["resave", "new"]), 1, rng.randrange(rank1_points)) for _ in range(3)]
    return kinds


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("work", help="an empty directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-trials", type=int, default=6)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _warm_up(os.path.join(args.work, "warm-up"))
    started = time.perf_counter()
    outcomes, failures = [], []
    step = 0

    def trial_of(index: int, kind: str, kill_rank: int, kill_at: int) -> dict:
        nonlocal step
        step += 2
        return {"index": index, "stage": (1, 3)[index % 2], "step_a": step,
                "step_b": step if kind == "resave" else step + 1, "kind": kind,
                "kill_rank": kill_rank, "kill_at": kill_at}

    def run(trial: dict, names: Optional[list[str]] = None) -> None:
        statuses = run_trial(args.work, trial)
        a, b = 2 * trial["index"], 2 * trial["index"] + 1
        killed = any(os.WIFSIGNALED(s) for s in statuses.values())
        completed = all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses.values())
        point = names[trial["kill_at"]] if names and trial["kill_at"] < len(names) else None
        outcome = {"kind": trial["kind"], "rank": trial["kill_rank"], "k": trial["kill_at"], "point": point,
                   "killed": killed}
        try:
            with open(os.path.join(args.work, f"leftovers_{trial['index']}.json")) as f:
                left = json.load(f)
            if left:
                raise AssertionError(f"after a clean save, leftovers remain: {left}")
            held = check_latest(args.work, (b,) if completed else (a, b))
            outcome["latest"] = "new" if held == b else "previous"
        except Exception as error:  # noqa: BLE001 - collected and reported together
            outcome["latest"] = f"FAILED: {type(error).__name__}: {str(error)[:300]}"
            failures.append(outcome)
        outcomes.append(outcome)

    calibration = trial_of(0, "resave", -1, NO_KILL)
    run(calibration)
    resave_points = _points(args.work, calibration)
    new = trial_of(1, "new", -1, NO_KILL)
    run(new)
    new_points = _points(args.work, new)
    rank1_points = _points(args.work, new, rank=1)
    kinds = plan(args.seed, len(resave_points), len(new_points), len(rank1_points), args.random_trials)
    names = {(0, "resave"): resave_points, (0, "new"): new_points}
    for index, (kind, rank, k) in enumerate(kinds, start=2):
        run(trial_of(index, kind, rank, k), names.get((rank, kind), rank1_points))
    print(json.dumps({"trials": len(outcomes), "failures": failures, "outcomes": outcomes,
                      "resave_points": resave_points, "seconds": round(time.perf_counter() - started, 1)}))
    return 0


def _points(work: str, trial: dict, rank: int = 0) -> list[str]:
    try:
        with open(os.path.join(work, f"points_{trial['index']}_{rank}.json")) as f:
            return json.load(f)
    except FileNotFoundError:  # the rank was killed before it could write them
        return []


if __name__ == "__main__":
    sys.exit(main())
