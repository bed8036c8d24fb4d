"""Tiny models and module-level rank workers shared by the engine tests.

Every function here may run on a pool rank (``rank_pools.get(n).run(fn, ...)``)
or in-process with no process group (``run_local(fn, ...)``): workers look up
rank and world size themselves. Arguments and results are plain data (dicts,
lists, tensors) so they pickle.

[Note: the reference]
The equivalence workers train the sharded model and, in the same process, an
unwrapped deep copy (made before ``shard()``) on the *global* batch: every
rank's micro-batch is its slice of that batch, so the reference loss is the
mean over ranks of the per-rank losses. Gradients summed over micro-steps and
averaged over ranks by the engine must then equal the reference's gradients.
"""

from __future__ import annotations

import contextlib
import copy
import time


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardengine as se
from rank_pool import rank_world
from toy_models import Block, Net, build_model, make_optimizer  # noqa: F401 (Block, Net: used by importers)

TINY = 1e-12


def _single_thread() -> None:
    if dist.is_available() and dist.is_initialized():
        torch.set_num_threads(1)


def batch(spec: dict, step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of (step, micro): identical on every rank."""
    gen = torch.Generator().manual_seed(10_000 + 97 * step + micro + 1000 * spec["seed"])
    size = spec["per_rank_batch"] * world
    ids = torch.randint(0, spec["vocab"], (size,), generator=gen)
    targets = torch.randint(0, spec["vocab"], (size,), generator=gen)
    return ids, targets


def base_spec_for(**overrides) -> dict:
    """A small default model spec (see ``build_model`` and ``batch``)."""
    spec = dict(seed=0, vocab=11, dim=7, hidden=[5, 3], tied=False, frozen=False, stage=0,
                optimizer="adam", micro_steps=1, steps=2, max_norm=1.0, per_rank_batch=3,
                bucket_mb=25.0)
    spec.update(overrides)
    return spec


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / max(b.abs().max().item(), TINY)).item()


# --------------------------------------------------------------------------- equivalence


def _uses_extra(spec: dict, step: int, rank: int) -> bool:
    """Which ranks take the optional branch at ``step`` (spec['extra_on'][step] lists them)."""
    return rank in spec.get("extra_on", [[]] * spec["steps"])[step]


def train_and_compare(spec: dict) -> dict:
    """Train the sharded model and the single-process reference; report the differences.

    spec: seed, vocab, dim, hidden, tied, frozen, stage, optimizer, micro_steps,
    steps, max_norm (None: no clipping), per_rank_batch, bucket_mb, and
    optionally extra / extra_on / shared_twice.
    """
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"], groups="blocks"), stage=spec["stage"],
                                bucket_mb=spec.get("bucket_mb", 25.0),
                                find_unused_parameters=spec.get("find_unused", False),
                                collectives=spec.get("collectives", "auto"), **spec.get("options", {}))
    ref_optimizer = make_optimizer(ref, spec["optimizer"], groups="blocks")
    norms, ref_norms = train_side_by_side(spec, model, optimizer, ref, ref_optimizer)
    return compare_to_reference(model, ref, norms, ref_norms)


def train_side_by_side(spec: dict, model, optimizer, ref, ref_optimizer, after_step=lambda: None):
    """``spec["steps"]`` steps of ``spec["micro_steps"]`` micro-batches: the sharded model on
    this rank's rows (no_sync but on the last), the reference on every rank's rows; clipping
    with ``spec["max_norm"]``. Returns the clipping norms (sharded, reference)."""
    rank, world = rank_world()
    b = spec["per_rank_batch"]
    norms, ref_norms = [], []
    for step in range(spec["steps"]):
        micro_steps = spec["micro_steps"]
        for micro in range(micro_steps):
            ids, targets = batch(spec, step, micro, world)
            mine = slice(rank * b, (rank + 1) * b)
            last = micro == micro_steps - 1
            with (contextlib.nullcontext() if last else model.no_sync()):
                out = model(ids[mine], use_extra=_uses_extra(spec, step, rank))
                (F.cross_entropy(out, targets[mine]) / micro_steps).backward()
            if spec.get("extra_on") is None:
                ref_loss = F.cross_entropy(ref(ids), targets)
            else:  # per-rank branches: mean over ranks of each rank's loss
                ref_loss = sum(F.cross_entropy(ref(ids[r * b:(r + 1) * b], use_extra=_uses_extra(spec, step, r)),
                                               targets[r * b:(r + 1) * b]) for r in range(world)) / world
            (ref_loss / micro_steps).backward()
        if spec.get("max_norm") is not None:
            norms.append(float(model.clip_grad_norm_(spec["max_norm"])))
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["max_norm"])))
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        after_step()
    return norms, ref_norms


def compare_to_reference(model, ref: nn.Module, norms: list[float], ref_norms: list[float]) -> dict:
    """What ``check_equivalence`` asserts: the sharded model's full state against the reference's."""
    full = model.full_state_dict()
    expected = ref.state_dict()
    return {
        "keys": sorted(full) == sorted(expected),
        "errors": {key: rel_err(full[key], expected[key]) for key in expected if key in full},
        "finite": all(bool(torch.isfinite(t).all()) for t in full.values()),
        "norms": norms,
        "ref_norms": ref_norms,
        "state": full,
    }


def check_equivalence(results: list[dict], tol: float = 2e-4, norm_tol: float = 1e-4,
                      extra_tol: dict[str, float] | None = None) -> None:
    """Assert (in the parent) what ``train_and_compare`` measured, on every rank.

    ``extra_tol`` widens the bound of named parameters by an allowance the caller derives
    (Muon's bf16 rounding: see test_matrix_optimizers.py)."""
    extra_tol = extra_tol or {}
    for rank, result in enumerate(results):
        assert result["keys"], f"rank {rank}: full_state_dict keys differ from the model's"
        assert result["finite"], f"rank {rank}: non-finite parameters"
        bad = {k: e for k, e in result["errors"].items() if not e <= tol + extra_tol.get(k, 0.0)}
        assert not bad, f"rank {rank}: parameters differ from the reference (rel err): {bad}"
        assert len(result["norms"]) == len(result["ref_norms"])
        for got, want in zip(result["norms"], result["ref_norms"]):
            assert abs(got - want) <= norm_tol * max(abs(want), TINY), \
                f"rank {rank}: clip_grad_norm_ returned {got}, reference {want}"
    first = results[0]
    for rank, result in enumerate(results[1:], start=1):
        assert result["norms"] == first["norms"], f"rank {rank} disagrees on the grad norm"
        for key, tensor in first["state"].items():
            assert torch.equal(result["state"][key], tensor), f"rank {rank} disagrees on {key}"


# --------------------------------------------------------------------------- wrap-time sync


def broadcast_at_wrap(spec: dict) -> dict:
    """Ranks seed differently and set the buffer to their rank; shard() must sync from rank 0."""
    _single_thread()
    rank, _ = rank_world()
    torch.manual_seed(spec["seed"] + 1000 * rank)
    net = build_model(spec)
    with torch.no_grad():
        net.shift.fill_(float(rank))
    original = {k: v.detach().clone() for k, v in net.state_dict().items()}
    model, _ = se.shard(net, torch.optim.Adam(net.parameters()), stage=spec["stage"])
    return {"original": original, "full": model.full_state_dict(),
            "live_buffer": net.shift.detach().clone()}


def train_meta_stage3(spec: dict) -> dict:
    """Build under the meta device, shard at stage 3 (materializes), train ``spec['steps']`` steps."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"] + rank)  # RNG may differ: rank 0's init is broadcast
    with torch.device("meta"):
        net = build_model({**spec, "buffer": False})
    meta_before = all(p.is_meta for p in net.parameters())
    model, optimizer = se.shard(net, lambda params: torch.optim.Adam(params, lr=1e-2), stage=3)
    params_bytes = model.memory_report().params
    padded = sum(bucket.layout.padded_numel for bucket in model.engine.buckets)
    b = spec["per_rank_batch"]
    losses = []
    for step in range(spec["steps"]):
        ids, targets = batch(spec, step, 0, world)
        loss = F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full = model.full_state_dict()
    return {"meta_before": meta_before, "params_bytes": params_bytes, "padded": padded,
            "world": world, "losses": losses, "state": full,
            "finite": all(bool(torch.isfinite(t).all()) for t in full.values()),
            "any_meta_after": any(p.is_meta for p in net.parameters())}


# --------------------------------------------------------------------------- memory


def memory_after_step(spec: dict) -> dict:
    """Memory report after one full step, with the buckets' layout sums to compare against."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in net.parameters() if not p.requires_grad)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]),
                                stage=spec["stage"], bucket_mb=spec.get("bucket_mb", 25.0),
                                **spec.get("options", {}))
    model.reset_comm_stats()
    buckets = model.engine.buckets
    b = spec["per_rank_batch"]
    ids, targets = batch(spec, 0, 0, world)
    F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
    optimizer.step()
    report_after_step = model.memory_report()
    optimizer.zero_grad()
    return {
        "world": world,
        "group": model.shard_group_size,  # what the buckets are sharded over (hybrid: k < world)
        "trainable": trainable,
        "frozen": frozen,
        "padded_grad": sum(bk.layout.padded_numel for bk in buckets if bk.requires_grad),
        "owned_grad": sum(f.numel for bk in buckets if bk.requires_grad for f in bk.layout.fragments(bk.rank)),
        "padded_all": sum(bk.layout.padded_numel for bk in buckets),
        "n_buckets": len(buckets),
        "report": report_after_step,
        "report_after_zero_grad": model.memory_report(),
    }


# --------------------------------------------------------------------------- communication


def comm_bytes_of_step(spec: dict) -> dict:
    """Bytes per collective kind for one step (no clipping), and the buckets' full sizes.

    With ``micro_steps`` > 1 the first micro-steps run under ``no_sync()`` and
    their traffic is reported separately.
    """
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = se.shard(net, make_optimizer(net, "adam"), stage=spec["stage"],
                                bucket_mb=spec.get("bucket_mb", 25.0),
                                collectives=spec.get("collectives", "auto"), **spec.get("options", {}))
    buckets = [(bk.layout.padded_numel * bk.full_param.element_size(), bk.requires_grad)
               for bk in model.engine.buckets]
    b = spec["per_rank_batch"]
    micro_steps = spec.get("micro_steps", 1)
    in_no_sync = None
    # the second step is measured: the first one also agrees on the batch weights' reference
    for step in range(2):
        model.reset_comm_stats()
        for micro in range(micro_steps):
            ids, targets = batch(spec, step, micro, world)
            last = micro == micro_steps - 1
            if last and micro_steps > 1:
                in_no_sync = dict(model.comm_stats().bytes_by_kind)
            with (contextlib.nullcontext() if last else model.no_sync()):
                out = model(ids[rank * b:(rank + 1) * b])
                (F.cross_entropy(out, targets[rank * b:(rank + 1) * b]) / micro_steps).backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = model.comm_stats()
    buffers = [b.numel() * b.element_size() for b in net.buffers()]
    return {"world": world, "group": model.shard_group_size, "buckets": buckets, "bytes": dict(stats.bytes_by_kind),
            "by_group": {name: dict(group.bytes_by_kind) for name, group in stats.by_group.items()},
            "ring_model_by_group": model.ring_model_bytes_by_group(micro_steps),
            "trainable_params": sum(len(bk.params) for bk in model.engine.buckets if bk.requires_grad),
            "bucket_shapes": [[tuple(p.shape) for p in bk.params] for bk in model.engine.buckets if bk.requires_grad],
            "buffer_bytes": buffers,
            "in_place_primitives": model.engine.comm.in_place_primitives,
            "ring_model": model.ring_model_bytes(micro_steps),
            "calls": dict(stats.calls_by_kind), "in_no_sync": in_no_sync}


# --------------------------------------------------------------------------- errors


def shard_expecting_error(case: str) -> dict:
    """Run one misuse case; return the exception's type and message (or None)."""
    _single_thread()
    try:
        misuse(case)
    except Exception as error:  # noqa: BLE001 - the caller asserts on type and message
        return {"type": type(error).__name__, "message": str(error),
                "is_config_error": isinstance(error, se.ConfigError),
                "is_value_error": isinstance(error, ValueError)}
    return {"type": None, "message": ""}


def _small() -> Net:
    torch.manual_seed(0)
    return Net(vocab=7, dim=5, hidden=[3])


def misuse(case: str) -> None:
    """One way of calling ``shard()`` wrongly (or, for a few cases, rightly)."""
    net = _small()
    adam = torch.optim.Adam(net.parameters())
    if case.startswith("stage="):
        stage = {"stage=5": 5, "stage=two": "two", "stage=True": True, "stage=-1": -1}[case]
        se.shard(net, adam, stage=stage)
    elif case == "unknown_option":
        se.shard(net, adam, stage=1, bukcet_mb=1.0)
    elif case == "negative_bucket_mb":
        se.shard(net, adam, stage=1, bucket_mb=-1.0)
    elif case == "bad_collectives":
        se.shard(net, adam, stage=2, collectives="nccl")
    elif case == "foreign_param":
        foreign = nn.Parameter(torch.zeros(3, 3))
        se.shard(net, torch.optim.Adam(list(net.parameters()) + [foreign]), stage=1)
    elif case == "wrap_twice_module":
        se.shard(net, adam, stage=1)
        se.shard(net, torch.optim.Adam(net.parameters()), stage=1)
    elif case == "wrap_twice_sharded":
        model, _ = se.shard(net, adam, stage=1)
        se.shard(model, torch.optim.Adam(model.parameters()), stage=1)
    elif case.startswith("lbfgs"):
        se.shard(net, torch.optim.LBFGS(net.parameters()), stage=int(case[-1]))
    elif case.startswith("stepped_optimizer"):
        net(torch.tensor([1, 2])).sum().backward()
        adam.step()
        adam.zero_grad()
        se.shard(net, adam, stage=int(case[-1]))
    elif case.startswith("meta_stage"):
        with torch.device("meta"):
            meta = Net(vocab=7, dim=5, hidden=[3], buffer=False)
        se.shard(meta, torch.optim.Adam(meta.parameters()), stage=int(case[-1]))
    elif case == "ranks_disagree":
        rank, _ = rank_world()
        torch.manual_seed(0)
        other = Net(vocab=7, dim=5, hidden=[3 + rank])
        se.shard(other, torch.optim.Adam(other.parameters()), stage=2)
    else:
        raise ValueError(f"unknown case {case}")


def _init_a(module: nn.Module) -> None:
    pass


def _init_b(module: nn.Module) -> None:
    pass


# One way per case in which rank 1 calls shard() differently from rank 0: case -> (rank 0, rank 1).
DISAGREEMENTS: dict[str, tuple[dict, dict]] = {
    "stage": ({"stage": 1}, {"stage": 2}),
    "collectives": ({"collectives": "auto"}, {"collectives": "native"}),
    "param_dtype": ({}, {"param_dtype": "bf16"}),
    "wrap": ({"stage": 3}, {"stage": 3, "wrap": (Block,)}),
    "units": ({"stage": 3}, {"stage": 3, "sequential": True}),
    "param_init_fn": ({"stage": 3, "param_init_fn": _init_a}, {"stage": 3, "param_init_fn": _init_b}),
    "timeout_s": ({}, {"timeout_s": 10}),
    "find_unused_parameters": ({}, {"find_unused_parameters": True}),
    "optimizer": ({}, {"optimizer": "sgd"}),
    "lr": ({}, {"lr": 1e-2}),
    "bad_option_on_one_rank": ({}, {"bucket_mb": "25"}),
}


def shard_disagreeing(case: str) -> dict:
    """Rank 1 calls shard() differently (``DISAGREEMENTS[case]``); the error each rank gets."""
    _single_thread()
    rank, _ = rank_world()
    options = dict(DISAGREEMENTS[case][min(rank, 1)])
    options.setdefault("stage", 1)
    net = _small()
    if options.pop("sequential", False):  # same parameter names, but no ModuleList: other units
        net.blocks = nn.Sequential(*net.blocks)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1) if options.pop("optimizer", None) == "sgd" \
        else torch.optim.Adam(net.parameters(), lr=options.pop("lr", 1e-3))
    started = time.monotonic()
    try:
        se.shard(net, optimizer, **options)
    except Exception as error:  # noqa: BLE001 - the caller asserts on type and message
        return {"type": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started,
                "is_config_error": isinstance(error, se.ConfigError)}
    return {"type": None, "message": "", "seconds": time.monotonic() - started}


def skip_backward_on_rank1(timeout_s: float, stage: int) -> dict:
    """Rank 1 skips backward; rank 0's gradient reduction must fail after ``timeout_s``."""
    _single_thread()
    rank, _ = rank_world()
    torch.manual_seed(0)
    net = Net(vocab=7, dim=5, hidden=[3])
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage,
                                timeout_s=timeout_s)
    started = time.monotonic()
    try:
        loss = model(torch.tensor([1, 2, 3])).sum()
        if rank == 0:
            loss.backward()
            optimizer.step()
    except Exception as error:  # noqa: BLE001
        return {"rank": rank, "error": type(error).__name__, "message": str(error),
                "is_collective_error": isinstance(error, se.CollectiveError),
                "seconds": time.monotonic() - started}
    return {"rank": rank, "error": None, "seconds": time.monotonic() - started}
