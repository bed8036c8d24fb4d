"""Rank workers for the drop-in fidelity tests: torch idioms on the wrapped model and optimizer.

Each worker runs on every rank of a pool (or in-process) and returns plain
data: outcomes of idioms as ``"ok"`` or ``"<ErrorType>: message"``, tensors to
compare with a single-process reference trained in the same process (see
engine_cases' [Note: the reference]).
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardengine as se
from engine_cases import _single_thread, batch, rel_err
from rank_pool import rank_world
from toy_models import build_model


def outcome(action: Callable[[], Any]) -> str:
    """``"ok"`` or ``"<ExceptionType>: <message>"`` of running ``action``."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the test inspects which error it was
        return f"{type(error).__name__}: {error}"
    return "ok"


def _shard(spec: dict, net: nn.Module, optimizer=None, **options):
    optimizer = optimizer or torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    return se.shard(net, optimizer, stage=spec["stage"], bucket_mb=spec.get("bucket_mb", 25.0),
                    **{**spec.get("options", {}), **options})


def _train_steps(model, optimizer, spec: dict, steps: int, first_step: int = 0) -> None:
    rank, world = rank_world()
    b = spec["per_rank_batch"]
    for step in range(first_step, first_step + steps):
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        optimizer.step()
        optimizer.zero_grad()


# --------------------------------------------------------------------------- parameters between steps


def idioms_between_steps(spec: dict) -> dict:
    """After a step: what each everyday idiom on a parameter/model does."""
    _single_thread()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = _shard(spec, net)
    _train_steps(model, optimizer, spec, 1)
    p = net.blocks[0].lin.weight
    buffer = io.BytesIO()
    results = {
        "print": outcome(lambda: repr(p)),
        "sum": outcome(lambda: p.sum()),
        "detach_clone": outcome(lambda: p.detach().clone()),
        "numpy": outcome(lambda: p.detach().numpy()),
        "data": outcome(lambda: p.data + 0),
        "parameters_to_vector": outcome(lambda: torch.nn.utils.parameters_to_vector(model.parameters())),
        "deepcopy_model": outcome(lambda: copy.deepcopy(model)),
        "deepcopy_module": outcome(lambda: copy.deepcopy(model.module)),
        "save_param": outcome(lambda: torch.save(p, io.BytesIO())),
        "sum_by_keyword": outcome(lambda: torch.sum(input=p)),
        "init_by_keyword": outcome(lambda: torch.nn.init.uniform_(p)),  # nn.init passes tensor=p
        "module_state_dict": outcome(lambda: model.module.state_dict()),
        "to_float64": outcome(lambda: model.to(torch.float64)),
        "double": outcome(lambda: model.double()),
        "to_same_device": outcome(lambda: model.to("cpu")),
        "cpu_same_device": outcome(lambda: model.cpu()),
        "float_same_dtype": outcome(lambda: model.float()),  # fp32 already: a no-op, as on a module
        "count_params": sum(q.numel() for q in model.parameters()),
        "shape": tuple(p.shape),
    }
    full = model.full_state_dict()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    plain = build_model(spec)
    plain.load_state_dict(loaded)
    results["state_dict_round_trip"] = max(rel_err(plain.state_dict()[k], full[k]) for k in full)
    with model.summon_full_params():
        results["summoned"] = max(rel_err(q.detach(), full[n]) for n, q in net.named_parameters())
        ema = copy.deepcopy(model)
        with torch.no_grad():
            p.add_(1.0)  # written back on exit
    results["ema_type"] = type(ema).__name__
    results["ema_values"] = max(rel_err(q.detach(), full[n]) for n, q in ema.named_parameters())
    results["ema_forward"] = outcome(lambda: ema(torch.tensor([0, 1])))
    after = model.full_state_dict()
    key = "blocks.0.lin.weight"
    results["writeback"] = rel_err(after[key], full[key] + 1.0)
    results["trains_after"] = outcome(lambda: _train_steps(model, optimizer, spec, 1, first_step=1))
    return results


def full_values_under_mixed_precision(spec: dict) -> dict:
    """bf16 compute: every save path returns the fp32 masters."""
    _single_thread()
    torch.manual_seed(spec["seed"])
    net = build_model({**spec, "buffer": False})
    model, optimizer = _shard(spec, net, param_dtype="bf16")
    _train_steps(model, optimizer, spec, 2)
    full = model.full_state_dict()
    compute = model.full_state_dict(compute_dtype=True)
    state = model.state_dict()
    with model.summon_full_params():
        summoned = {n: q.detach().clone() for n, q in net.named_parameters()}
    key = "blocks.0.lin.weight"
    return {"dtype": str(full[key].dtype), "compute_dtype": str(compute[key].dtype),
            "state_dict_equal": all(torch.equal(state[k], full[k]) for k in full),
            "summoned_equal": all(torch.equal(summoned[k], full[k]) for k in summoned),
            "not_bf16_representable": not torch.equal(full[key], full[key].bfloat16().float()),
            "compute_is_rounded_master": torch.equal(compute[key], full[key].bfloat16())}


def moved_after_shard(spec: dict) -> dict:
    """``model.module.double()`` behind the engine's back is caught at the next forward."""
    _single_thread()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = _shard(spec, net)
    results = {"module_double": outcome(lambda: net.double())}
    results["next_forward"] = outcome(lambda: _train_steps(model, optimizer, spec, 1))
    return results


# --------------------------------------------------------------------------- gradients


def gradients_as_users_read_them(spec: dict) -> dict:
    """After backward: p.grad, torch's clip_grad_norm_, and summoned full gradients."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    model, optimizer = _shard(spec, net)
    b = spec["per_rank_batch"]
    ids, targets = batch(spec, 0, 0, world)
    F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
    F.cross_entropy(ref(ids), targets).backward()
    p = net.blocks[0].lin.weight
    results = {"read_grad": outcome(lambda: p.grad + 0),
               "torch_clip": outcome(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
               "grad_is_none_check": outcome(lambda: [q.grad is None for q in model.parameters()])}
    if results["read_grad"] == "ok":
        results["grad_error"] = rel_err(p.grad, ref.blocks[0].lin.weight.grad)
    with model.summon_full_params(with_grads=True):
        errors = [rel_err(q.grad, r.grad) for q, r in zip(net.parameters(), ref.parameters())
                  if r.grad is not None]
        results["torch_clip_inside"] = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9))
    results["summoned_grad_error"] = max(errors)
    results["ref_norm"] = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    results["engine_norm"] = float(model.clip_grad_norm_(1e9))
    optimizer.step()
    optimizer.zero_grad()
    results["read_grad_after_step"] = outcome(lambda: p.grad)
    return results


# --------------------------------------------------------------------------- optimizer


def train_with_closure(spec: dict) -> dict:
    """``optimizer.step(closure)`` against a single-process reference doing the same."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    model, optimizer = _shard(spec, net)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    b = spec["per_rank_batch"]
    losses = []
    for step in range(spec["steps"]):
        ids, targets = batch(spec, step, 0, world)

        def closure():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b])
            loss.backward()
            return loss

        def ref_closure():
            ref_optimizer.zero_grad()
            loss = F.cross_entropy(ref(ids), targets)
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure)))
        ref_optimizer.step(ref_closure)
    full = model.full_state_dict()
    return {"errors": {k: rel_err(full[k], v) for k, v in ref.state_dict().items()}, "losses": losses}


def optimizer_state_forms(spec: dict) -> dict:
    """full_optimizer_state_dict vs a plain torch optimizer trained the same way; round trips."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    groups = lambda m: [{"params": list(m.blocks.parameters()), "lr": 3e-3},  # noqa: E731
                        {"params": [q for n, q in m.named_parameters() if not n.startswith("blocks.")],
                         "lr": 1e-2, "weight_decay": 0.0}]
    model, optimizer = _shard(spec, net, optimizer=torch.optim.AdamW(groups(net), weight_decay=0.1))
    ref_optimizer = torch.optim.AdamW(groups(ref), weight_decay=0.1)
    b = spec["per_rank_batch"]
    for step in range(2):
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        F.cross_entropy(ref(ids), targets).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    full = model.full_optimizer_state_dict(optimizer)
    expected = ref_optimizer.state_dict()
    results = {"same_keys": sorted(full["state"]) == sorted(expected["state"]),
               "groups": [(sorted(g["params"]), g["lr"]) for g in full["param_groups"]] ==
                         [(sorted(g["params"]), g["lr"]) for g in expected["param_groups"]],
               "state_error": max(rel_err(full["state"][i][k], v) for i, s in expected["state"].items()
                                  for k, v in s.items() if torch.is_tensor(v)),
               "plain_loads_full": outcome(lambda: torch.optim.AdamW(groups(copy.deepcopy(ref)))
                                           .load_state_dict(copy.deepcopy(full)))}
    local = optimizer.state_dict()
    results["local_round_trip"] = outcome(lambda: optimizer.load_state_dict(copy.deepcopy(local)))
    # Resume from a plain torch run: load its state, then both train two more steps.
    ref_state = copy.deepcopy(ref_optimizer.state_dict())
    results["load_plain"] = outcome(lambda: model.load_full_optimizer_state_dict(optimizer, ref_state))
    model.load_state_dict(ref.state_dict())
    for step in range(2, 4):
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        F.cross_entropy(ref(ids), targets).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    after = model.full_state_dict()
    results["resumed_error"] = max(rel_err(after[k], v) for k, v in ref.state_dict().items())
    results["full"] = full
    return results


def load_foreign_local_state(spec: dict, saved: dict) -> str:
    """A sharded optimizer state from another layout is refused with a clear error."""
    _single_thread()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = _shard(spec, net)
    return outcome(lambda: optimizer.load_state_dict(saved))


def local_optimizer_state(spec: dict) -> dict:
    _single_thread()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    model, optimizer = _shard(spec, net)
    _train_steps(model, optimizer, spec, 1)
    return optimizer.state_dict()


# --------------------------------------------------------------------------- trainable set


def flip_requires_grad(spec: dict) -> dict:
    """Freezing a trained parameter for a step is exact: it is left untouched (and its Adam step count)."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    model, optimizer = _shard(spec, net)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    b = spec["per_rank_batch"]
    for step in range(4):
        frozen = step in (1, 2)
        for m in (net, ref):
            m.head.weight.requires_grad_(not frozen)
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        F.cross_entropy(ref(ids), targets).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    full = model.full_state_dict()
    return {k: rel_err(full[k], v) for k, v in ref.state_dict().items()}


# --------------------------------------------------------------------------- buffers


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batchnorm_replicas(spec: dict) -> dict:
    """Every rank trains on its own data; rank 0's BatchNorm statistics win (DDP's semantics)."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = BatchNormNet()
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"],
                                broadcast_buffers=spec["broadcast_buffers"])
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(5, 6, generator=gen) * (1 + rank)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(torch.ones(2, 6))
    bn = net.blocks[0][1]
    return {"mean": bn.running_mean.clone(), "var": bn.running_var.clone(), "out": out,
            "batches": int(bn.num_batches_tracked)}


def ddp_batchnorm_rank0(spec: dict) -> dict:
    """The same run under torch DDP, for its rank 0 statistics."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(0)
    net = BatchNormNet()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(5, 6, generator=gen) * (1 + rank)
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    bn = net.blocks[0][1]
    return {"mean": bn.running_mean.clone(), "var": bn.running_var.clone()}


# --------------------------------------------------------------------------- ranks out of step


class Faulty(nn.Module):
    """A model whose forward raises on one rank at one call (to be caught by the training loop)."""

    def __init__(self, fail_rank: int, fail_call: int):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.fail_rank, self.fail_call, self.calls = fail_rank, fail_call, 0

    def forward(self, x):
        self.calls += 1
        x = self.blocks[0](x)
        if self.calls == self.fail_call and rank_world()[0] == self.fail_rank:
            raise ValueError("bad batch")
        return self.blocks[1](x)


def exception_caught_on_one_rank(spec: dict) -> dict:
    """Rank 1's forward raises once; the loop catches it and carries on (skips that batch)."""
    _single_thread()
    torch.manual_seed(0)
    net = Faulty(fail_rank=1, fail_call=2)
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"],
                                timeout_s=spec.get("timeout_s", 30))
    errors = []
    for step in range(4):
        try:
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        except ValueError:
            optimizer.zero_grad()
            continue
        except se.CollectiveError as error:
            errors.append(str(error))
            break
    return {"errors": errors}


def extra_forward_on_one_rank(spec: dict) -> dict:
    """Rank 1 runs one training forward more than rank 0 (no collective in it at stages 0-2):
    the step's agreement all-reduce catches it, on every rank."""
    _single_thread()
    rank, _ = rank_world()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"],
                                timeout_s=spec.get("timeout_s", 30))
    errors = []
    try:
        for step in range(3):
            if step == 1 and rank == 1:
                model(torch.randn(3, 4))  # a stray training forward, no backward
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    except se.CollectiveError as error:
        errors.append(str(error))
    return {"errors": errors}
