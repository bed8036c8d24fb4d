"""Rank workers for stage 3's parameters on disk (``offload_params="disk"``): training,
placement, what is resident when, reports and checkpoints, against the run with everything
in memory.

The runs reuse the disk tier's model and loop (disk_offload_cases.py): Adam, two
micro-batches per step (the first under ``no_sync()``) and gradient clipping.
"""

from __future__ import annotations

import os

import torch

import shardengine as se
from disk_offload_cases import VOCAB, _loss, _train
from param_offload_cases import _differ, _resumed, _shard, grown_runs, reports_after_step
from toy_models import Net


def on_disk(path: str) -> dict:
    return {"offload_params": "disk", "offload_path": path}


def _misplaced(model) -> list[str]:
    """Shards not in files, or memory the plan does not allow (nothing gathered between steps)."""
    engine, problems = model.engine, []
    files = engine.disk.files
    for index, bucket in enumerate(engine.buckets):
        shard = bucket.kept_shard if bucket.kept_shard is not None else bucket.master
        if not files.holds(shard):
            problems.append(f"bucket {index}: its parameter shard is not in a file")
        if bucket.requires_grad and bucket.kept_shard is not None:
            problems.append(f"bucket {index}: a trained bucket keeps a shard beside its master")
        if bucket.grad_home != torch.device("cpu"):
            problems.append(f"bucket {index}: reduced gradients kept on {bucket.grad_home}")
        if bucket.full_params_live:
            problems.append(f"bucket {index}: full parameters left gathered after the step")
    return problems


def disk_matches_memory(path: str, precision: dict, frozen: bool) -> list[str]:
    """Names of the weights whose bits differ from the in-memory run, and placement problems."""
    runs = []
    for options in (on_disk(path), {}):
        model, optimizer = _shard({**options, **precision}, frozen)
        _train(model, optimizer)
        runs.append(model)
    return _misplaced(runs[0]) + _differ(runs[1].full_state_dict(), runs[0].full_state_dict())


def grown_disk_matches_memory(path: str, precision: dict) -> list[str]:
    """A block frozen at shard() and unfrozen after a step: its kept shard, in a file, becomes a
    master in a file (stages/replan.py); the same bits as in memory throughout."""
    on_files, in_memory = grown_runs(on_disk(path), precision)
    return _misplaced(on_files) + _differ(in_memory.full_state_dict(), on_files.full_state_dict())


def tier_reports(path: str, precision: dict) -> dict:
    """memory_report() after a step and one more backward (the reduced gradients held), with the
    parameters on disk and on the host, and the counts the disk run's report must equal. Each
    rank has a directory of its own: another rank's files being made are not this rank's."""
    path = os.path.join(path, f"rank{se.distributed.rank()}")
    os.makedirs(path, exist_ok=True)
    reports, model = reports_after_step({"host": {"offload_params": True}, "disk": on_disk(path)}, precision)
    buckets = model.engine.buckets
    reports["frozen_shard"] = sum(b.kept_shard.numel() * b.kept_shard.element_size()
                                  for b in buckets if not b.requires_grad)
    reports["master_shards"] = sum(b.layout.shard_numel * torch.float32.itemsize for b in buckets if b.requires_grad)
    reports["files_left"] = [f for f in os.listdir(path) if f.startswith("shardengine-disk")]
    return reports


def checkpoint_between_tiers(path: str, checkpoint: str, precision: dict) -> list[str]:
    """Saved from the disk tier and resumed in memory, and back, against the run in memory
    throughout."""
    disk, memory = {**on_disk(path), **precision}, dict(precision)
    want = _resumed(memory, memory, checkpoint + "-memory")
    return (_differ(want, _resumed(disk, memory, checkpoint + "-from-disk"))
            + _differ(want, _resumed(memory, disk, checkpoint + "-to-disk")))


def resumed_in_memory(checkpoint: str, record: str) -> list[str]:
    """After a killed disk run: its last checkpoint loaded in memory against the weights it
    recorded when saving it."""
    model, optimizer = _shard({}, frozen=True)
    se.load_checkpoint(checkpoint, model, optimizer)
    return _differ(torch.load(record), model.full_state_dict())


# --------------------------------------------------------------------------- what is resident when


def resident_file_bytes(path: str) -> int:
    """Bytes of the disk tier's files under ``path`` resident in this process now (their
    mappings' Rss in /proc/self/smaps: the files are unlinked, so named ``... (deleted)``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5].startswith(os.path.join(path, "shardengine-disk-"))
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _wide_net() -> Net:
    """Six units whose shards span many pages each, so residency is measured in units."""
    torch.manual_seed(0)
    return Net(VOCAB, 128, [128] * 4, residual=True, buffer=False)


def residency(path: str, precision: dict) -> dict:
    """The disk tier's resident bytes sampled at every unit's forward and backward (after the
    worker's queue is done) and after shard() and each step, with each unit's shard bytes."""
    net = _wide_net()
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=0.01), stage=3,
                                **on_disk(path), **precision)
    engine = model.engine
    samples: list[int] = []

    def resident() -> int:
        engine.disk.submit(lambda _: None, []).result()  # reads queued before now are in, releases done
        return resident_file_bytes(path)

    def sample(*_) -> None:
        samples.append(resident())

    for block in net.blocks:
        block.register_forward_pre_hook(sample)
        block.register_full_backward_pre_hook(sample)
    after = [resident()]
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, 4), generator=generator)
        _loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        after.append(resident())
    files = engine.disk.files
    units = [sum(files.nbytes(t) for b in unit.buckets for t in engine.disk_params._shard(b))
             for unit in engine.layout.units]
    report = model.memory_report()
    return {"samples": samples, "after": after, "units": units,
            "in_files": report.disk_params + report.disk_optimizer_states}
