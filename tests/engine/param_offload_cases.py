"""Rank workers for stage 3's parameters on the host (``offload_params=True``): training,
placement, reports and checkpoints against the same run with everything resident.

The runs reuse the disk tier's model and loop (disk_offload_cases.py): Adam, two
micro-batches per step (the first under ``no_sync()``) and gradient clipping.
"""

from __future__ import annotations

import torch

import shardengine as se
from disk_offload_cases import VOCAB, _loss, _net, _train

HOST = {"offload_params": True}


def _shard(options: dict, frozen: bool):
    net = _net()
    if frozen:  # a frozen block: a bucket without a master, whose kept shard moves to the host
        net.blocks[1].requires_grad_(False)
    return se.shard(net, torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.05),
                    stage=3, bucket_mb=0.001, **options)


def _differ(want: dict, got: dict) -> list[str]:
    return [k for k in want if not torch.equal(want[k], got[k])]


def _misplaced(model) -> list[str]:
    """Tensors not where the storage plan puts them (on a CPU-only machine the host is the
    device, so this checks the plan each bucket was given, and that nothing stays resident
    but the units a fraction or budget keeps, which hold their states as without offload)."""
    host, problems = torch.device("cpu"), []
    config = model.engine.config
    for index, bucket in enumerate(model.engine.buckets):
        if bucket.param_home is None and config.offload.partial_params:  # a resident unit's bucket
            if bucket.grad_home is not None or (bucket.requires_grad and
                                                bucket.master_is_separate != config.mixed_precision):
                problems.append(f"bucket {index}: a resident bucket not kept as without offload")
        elif bucket.param_home != host or bucket.grad_home != host:
            problems.append(f"bucket {index}: homes {bucket.param_home}, {bucket.grad_home}")
        elif bucket.requires_grad and (bucket.kept_shard is not None or bucket.master.device != host):
            problems.append(f"bucket {index}: a trained bucket keeps a shard beside its host master")
        if bucket.full_params_live:
            problems.append(f"bucket {index}: full parameters left gathered after the step")
    return problems


def host_matches_resident(precision: dict, frozen: bool, host: dict = HOST) -> list[str]:
    """Names of the weights whose bits differ from the resident run, and placement problems."""
    runs = []
    for options in (host, {}):
        model, optimizer = _shard({**options, **precision}, frozen)
        _train(model, optimizer)
        runs.append(model)
    return _misplaced(runs[0]) + _differ(runs[1].full_state_dict(), runs[0].full_state_dict())


def reports_after_step(runs: dict[str, dict], precision: dict) -> tuple[dict, object]:
    """memory_report() of each named run after a step and one more backward (the reduced
    gradients held), a frozen block included; and the last run's model."""
    reports = {}
    for name, options in runs.items():
        model, optimizer = _shard({**options, **precision}, frozen=True)
        _train(model, optimizer, steps=1)
        _loss(model, torch.randint(0, VOCAB, (3, 5))).backward()  # reduced gradients held
        reports[name] = model.memory_report().as_dict()
    return reports, model


def tier_reports(precision: dict) -> dict:
    """The reports with the parameters on the host and resident, and the counts the host run's
    report must equal."""
    reports, model = reports_after_step({"host": HOST, "resident": {}}, precision)
    buckets = model.engine.buckets
    param_dtype = model.engine.config.param_dtype or torch.float32
    # each count is a shard's numel x its itemsize (the layout's shard, padding included)
    reports["frozen_shard"] = sum(b.layout.shard_numel * param_dtype.itemsize for b in buckets if not b.requires_grad)
    reports["grad_shards"] = sum(b.layout.shard_numel * b.grad_dtype.itemsize for b in buckets if b.requires_grad)
    stepped = [b for b in buckets if b.requires_grad]
    reports["master_shards"] = sum(b.layout.shard_numel * torch.float32.itemsize for b in stepped)
    reports["moments"] = sum(2 * torch.float32.itemsize * sum(p.param.numel() for p in b.master_pieces)
                             for b in stepped)
    return reports


def _resumed(before: dict, after: dict, checkpoint: str) -> dict[str, torch.Tensor]:
    """Train 2 steps with ``before``, save, load into a fresh run with ``after``, train 1 more."""
    model, optimizer = _shard(before, frozen=True)
    _train(model, optimizer, steps=2)
    se.save_checkpoint(checkpoint, model, optimizer)
    resumed, resumed_optimizer = _shard(after, frozen=True)
    se.load_checkpoint(checkpoint, resumed, resumed_optimizer)
    _train(resumed, resumed_optimizer, steps=1, seed=2)
    return resumed.full_state_dict()


def checkpoint_between_tiers(checkpoint: str, precision: dict) -> list[str]:
    """Saved with the parameters on the host and resumed resident, and back, against the run
    resident throughout."""
    host, resident = {**HOST, **precision}, dict(precision)
    want = _resumed(resident, resident, checkpoint + "-resident")
    return (_differ(want, _resumed(host, resident, checkpoint + "-from-host"))
            + _differ(want, _resumed(resident, host, checkpoint + "-to-host")))


def grown_host_matches_resident(precision: dict, host: dict = HOST) -> list[str]:
    """A block frozen at shard() and unfrozen after a step (its shard, on the host, becomes a
    host master: stages/replan.py): the same bits as resident throughout."""
    offloaded, resident = grown_runs(host, precision)
    return _misplaced(offloaded) + _differ(resident.full_state_dict(), offloaded.full_state_dict())


def grown_runs(offload: dict, precision: dict) -> list:
    """The models of a run with ``offload`` and one resident, each with a block frozen at
    shard() and unfrozen after a step."""
    runs = []
    for options in (offload, {}):
        net = _net()
        net.blocks[1].requires_grad_(False)  # in the optimizer from the start, as torch allows
        model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=0.05), stage=3,
                                    bucket_mb=0.001, **options, **precision)
        _train(model, optimizer, steps=1)
        net.blocks[1].requires_grad_(True)
        _train(model, optimizer, steps=2, seed=2)
        runs.append(model)
    return runs


def muon_tier_matches_resident(offload: dict) -> tuple[list[str], tuple[bool, bool]]:
    """A whole-tensor optimizer (Muon steps each whole matrix) with ``offload`` (every unit's, or a
    fraction's, parameters on the host): the names whose weights differ from the run with everything
    resident, and whether this rank holds model states on the device and on the host."""
    from torch import nn

    runs = []
    for options in (offload, {}):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 6, bias=False))
        model, optimizer = se.shard(net, torch.optim.Muon(net.parameters(), lr=0.02), stage=3,
                                    bucket_mb=0.0001, wrap=[nn.Linear], **options)
        generator = torch.Generator().manual_seed(torch.distributed.get_rank())
        for _ in range(3):
            model(torch.randn(4, 6, generator=generator)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append(model.full_state_dict())
        if options:  # where this rank's model states are (a whole matrix's state lives on its owner)
            report = model.memory_report()
            tiers = (report.params + report.optimizer_states > 0, report.host_params + report.host_optimizer_states > 0)
    return [k for k in runs[1] if not torch.equal(runs[0][k], runs[1][k])], tiers
