"""Checkpoints at 1,024 simulated ranks: real files, what rank 0 writes and reads, resharding N -> M.

    python benchmarks/bench_checkpoint_scale.py                     # N=1024, loads at 512/1024/2048
    python benchmarks/bench_checkpoint_scale.py --ranks 256 --load-ranks 128,384

Each simulated rank is the real engine in this process: a fake process group of N
ranks opened at that rank (``torch.testing``'s ``fake`` backend: collectives do
nothing), the tiny GPT sharded at ``--stage`` and stepped once (AdamW: values and
two state tensors per element), then the save's per-rank phases of
``shardengine/state/checkpoint`` run on real files: rank 0 prepares, every rank
writes its file and sidecar, rank 0 publishes, and a second save (``keep=1``)
prunes the first, every rank deleting its own files. What the phase agreements
send (one all-reduce of a count, one broadcast) is not file work and is not timed.
Per phase: the time per rank (median, max; ranks write in parallel on a cluster, so
the slowest is what a save waits for) and rank 0's time; bytes rank 0 wrote and read
(``/proc/self/io``: every read and write it made, cached or not).

Loads at M ranks (``--load-ranks``, resharding when M != N) run each sampled rank's
read (``_prepare_load``) and apply; the sample is rank 0, the last rank and
``--sample`` others. Each loaded rank's records (what it would save) are checked
equal, value and optimizer state, to the consolidated checkpoint. The same
checkpoint rewritten as format 1 (every rank's files and index in rank 0's
manifest) is loaded too, for comparison. Results: a table and
``benchmarks/results/bench_checkpoint_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import shardengine as se
from shardengine.state.checkpoint import MANIFEST
from shardengine.state.checkpoint.engine_state import _apply, _prepare_load, _records
from shardengine.state.checkpoint.format import build_manifest
from shardengine.state.checkpoint.writing import (hold_own_files, prepare_save, publish, remove_directories,
                                                  remove_set_aside, write_rank_files)
from shardengine.state.consolidate import consolidate, consolidated_optimizer_state
from shardengine.testing.models import build_gpt, example_inputs, lm_loss

HERE = os.path.dirname(os.path.abspath(__file__))


def io_bytes() -> tuple[int, int]:
    """(read, written) by this process so far: every read()/write(), from /proc/self/io."""
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


class Measured:
    """Time and bytes of one block of work."""

    def __enter__(self):
        self.read0, self.written0 = io_bytes()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.started
        read, written = io_bytes()
        self.read, self.written = read - self.read0, written - self.written0


def simulated_rank(rank: int, world: int, stage: int, step: bool):
    """The engine of rank ``rank`` of ``world`` (a fake group), stepped once if ``step``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    torch.manual_seed(rank)
    net = build_gpt("tiny", vocab_size=64, seq_len=16, seed=0)
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=stage)
    if step:
        idx, targets = example_inputs(1, 16, vocab_size=64, seed=rank)
        lm_loss(model(idx), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # the fake gathers leave arbitrary values: make them finite, per rank
            for bucket in model.engine.buckets:
                for tensor in [bucket.master] if bucket.master is not None else []:
                    tensor.copy_(torch.randn_like(tensor))
    return model, optimizer


def save_all(root: str, world: int, stage: int, step: int) -> dict:
    """One save of every simulated rank, phase by phase; the second one prunes the first (keep=1)."""
    times, found = {"write": []}, {}
    with Measured() as prepared:
        step_number, holds = prepare_save(root, {"step": step})
    tmp_dir, final_dir = os.path.join(root, f".tmp_step_{step_number}"), os.path.join(root, f"step_{step_number}")
    for rank in range(world):
        model, optimizer = simulated_rank(rank, world, stage, step=True)
        with Measured() as wrote:
            shared = write_rank_files(tmp_dir, model.engine, optimizer, {"step": step})
            if holds:
                hold_own_files(root, os.path.basename(final_dir), rank)
        times["write"].append(wrote.seconds)
        if rank == 0:
            found["rank0_write"] = wrote
            manifest = build_manifest(model.engine, optimizer, shared)
    with Measured() as published:
        aside = publish(root, tmp_dir, final_dir, manifest, 1, holds)
    removing = []
    for rank in range(world):
        with Measured() as removed:
            remove_set_aside(root, aside, rank)
        removing.append(removed.seconds)
    with Measured() as cleared:
        remove_directories(root, aside)
    rank0 = [prepared, found["rank0_write"], published, cleared]
    return {"step_dir": final_dir, "write_median_s": statistics.median(times["write"]),
            "write_max_s": max(times["write"]), "remove_median_s": statistics.median(removing),
            "remove_max_s": max(removing), "rank0_s": sum(m.seconds for m in rank0) + removing[0],
            "rank0_written": sum(m.written for m in rank0), "rank0_read": sum(m.read for m in rank0),
            "manifest_bytes": os.path.getsize(os.path.join(final_dir, MANIFEST)),
            "files_per_rank": len([f for f in os.listdir(final_dir) if f.startswith("rank_1.")]),
            "pruned": aside}


def load_sample(step_dir: str, world: int, stage: int, ranks: list[int], reference: tuple) -> dict:
    """Each sampled rank of ``world`` reads and applies ``step_dir``; its records checked exact."""
    values, state = reference
    per_rank, rank0 = [], None
    for rank in ranks:
        model, optimizer = simulated_rank(rank, world, stage, step=False)
        with Measured() as loaded:
            prepared = _prepare_load(step_dir, model.engine, optimizer)
            _apply(prepared, model.engine, optimizer)
        per_rank.append(loaded.seconds)
        rank0 = loaded if rank == 0 else rank0
        for record in _records(model.engine, optimizer):
            name, start, end = record["name"], record["start"], record["end"]
            assert torch.equal(record["value"], values[name].reshape(-1)[start:end].to(record["value"].dtype)), name
            for key, piece in record.get("state", {}).items():
                assert torch.equal(piece, state[name][key].reshape(-1)[start:end]), (name, key)
    return {"median_s": statistics.median(per_rank), "max_s": max(per_rank), "ranks": len(ranks),
            "rank0_s": rank0.seconds, "rank0_read": rank0.read}


def as_format_1(step_dir: str, into: str) -> int:
    """``step_dir`` as format 1 wrote it: every rank's files and index in the manifest. Returns
    what its save's ``all_gather_object`` of every rank's entries delivered to each rank (N times
    the largest pickled entry: torch pads every rank's object to the largest)."""
    shutil.copytree(step_dir, into)
    with open(os.path.join(into, MANIFEST)) as f:
        manifest = json.load(f)
    largest = 0
    for rank in range(manifest["rank_files"]):
        with open(os.path.join(into, f"rank_{rank}.json")) as f:
            sidecar = json.load(f)
        os.remove(os.path.join(into, f"rank_{rank}.json"))
        info = {"bytes": sidecar["bytes"], "sha256": sidecar["sha256"]}
        manifest["files"][f"rank_{rank}.pt"] = info
        if sidecar["index"]:
            manifest.setdefault("index", {})[f"rank_{rank}.pt"] = sidecar["index"]
        entry = ("ok", {"files": {f"rank_{rank}.pt": info}, "index": {f"rank_{rank}.pt": sidecar["index"]}})
        largest = max(largest, len(pickle.dumps(entry)))
    manifest["format"] = "shardengine-universal/1"
    del manifest["rank_files"]
    with open(os.path.join(into, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)  # as format 1 wrote it
    return largest * manifest["world_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--load-ranks", default="512,1024,2048", help="world sizes to load at (resharding)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--sample", type=int, default=16, help="loading ranks besides the first and last")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "bench_checkpoint_scale.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the fake gathers leave arbitrary bits: no denormal slow paths
    root = tempfile.mkdtemp(prefix="ckpt_scale_", dir=args.dir)
    try:
        saves = [save_all(os.path.join(root, "ckpt"), args.ranks, args.stage, step) for step in (1, 2)]
        step_dir = saves[-1]["step_dir"]
        reference = (consolidate(step_dir), consolidated_optimizer_state(step_dir))
        rng = random.Random(0)
        loads = {}
        for world in (int(m) for m in args.load_ranks.split(",")):
            ranks = sorted({0, world - 1, *rng.sample(range(1, world - 1), min(args.sample, world - 2))})
            loads[world] = load_sample(step_dir, world, args.stage, ranks, reference)
        gathered = as_format_1(step_dir, os.path.join(root, "format1"))
        format1 = {"gathered_per_rank": gathered, "manifest_bytes": os.path.getsize(os.path.join(root, "format1", MANIFEST)),
                   "load": load_sample(os.path.join(root, "format1"), args.ranks, args.stage,
                                       [0, args.ranks - 1], reference)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    report(args, saves, loads, format1)


def report(args, saves: list[dict], loads: dict, format1: dict) -> None:
    save = saves[-1]
    print(f"\nN = {args.ranks} simulated ranks, stage {args.stage}, tiny GPT (real files: {save['files_per_rank']} per rank)")
    print(f"save (second, pruning the first): write per rank median {save['write_median_s'] * 1e3:.1f} ms, "
          f"max {save['write_max_s'] * 1e3:.1f} ms; remove own files median {save['remove_median_s'] * 1e3:.2f} ms; "
          f"rank 0 {save['rank0_s'] * 1e3:.0f} ms, wrote {save['rank0_written'] / 1024:.0f} KiB, "
          f"read {save['rank0_read'] / 1024:.0f} KiB; manifest {save['manifest_bytes'] / 1024:.1f} KiB "
          f"(format 1: {format1['manifest_bytes'] / 1024:.0f} KiB, and its save gathered "
          f"{format1['gathered_per_rank'] / 1024:.0f} KiB of indexes to every rank)")
    for world, load in loads.items():
        print(f"load at M = {world:>5} ({load['ranks']} ranks sampled, exact): per rank median "
              f"{load['median_s'] * 1e3:.0f} ms, max {load['max_s'] * 1e3:.0f} ms; rank 0 {load['rank0_s'] * 1e3:.0f} ms, "
              f"read {load['rank0_read'] / 1024:.0f} KiB")
    old = format1["load"]
    print(f"format 1 at M = {args.ranks}: per rank median {old['median_s'] * 1e3:.0f} ms; rank 0 "
          f"{old['rank0_s'] * 1e3:.0f} ms, read {old['rank0_read'] / 1024:.0f} KiB")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "saves": [{k: v for k, v in s.items()} for s in saves], "loads": loads,
                   "format1": format1}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
