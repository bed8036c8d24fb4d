"""Rank workers for the whole-tensor optimizer tests (Muon, Adafactor, several optimizers).

Same reference as engine_cases.py (see its [Note: the reference]): the sharded
model and an unwrapped copy trained on the global batch in the same process.
The model has odd matrices on purpose: a 1000x3 and a 3x1000 weight (owner
partition with very unequal sizes), a square one, an embedding and a head
that may be tied, biases (1-D: AdamW's in the Muon recipe), a block that may
be frozen, and an optional branch some ranks skip in some steps.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn

import shardengine as se
from engine_cases import _single_thread, batch, compare_to_reference, rank_world, train_side_by_side


class MatrixNet(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 3, wide: int = 1000, bias: bool = True,
                 tied: bool = False, frozen: bool = False, extra: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, wide, bias=bias),    # weight 1000 x 3
                                     nn.Linear(wide, dim, bias=bias),    # weight 3 x 1000
                                     nn.Linear(dim, dim, bias=bias)])
        self.extra = nn.Linear(dim, dim, bias=False) if extra else None
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        if frozen:
            self.blocks[2].requires_grad_(False)

    def forward(self, ids: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        if use_extra and self.extra is not None:
            x = x + self.extra(x)
        return self.head(x)


def build(spec: dict) -> MatrixNet:
    return MatrixNet(bias=spec["optimizer"] != "muon", tied=spec.get("tied", False),
                     frozen=spec.get("frozen", False), extra=spec.get("extra", False))


def make_optimizer(model: nn.Module, name: str):
    """Each with two param groups where it can, so group hyperparameters are exercised."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    if name == "muon":  # every parameter 2-D (no biases): Muon alone
        return torch.optim.Muon([{"params": blocks, "lr": 0.005}, {"params": rest, "lr": 0.003}],
                                weight_decay=0.01)
    if name == "adafactor":
        return torch.optim.Adafactor([{"params": blocks, "lr": 1e-2}, {"params": rest, "lr": 5e-3}],
                                     weight_decay=0.01)
    if name == "muon_adamw":
        return se.optim.muon_with_adamw(model, lr=0.005, weight_decay=0.01, adamw_lr=3e-3)
    if name == "sgd_adamw":
        return [torch.optim.SGD(blocks, lr=0.05, momentum=0.9),
                torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.05)]
    raise ValueError(name)


def train_matrix(spec: dict) -> dict:
    """Train sharded and reference; the comparison of engine_cases plus a momentum check."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build(spec)
    ref = copy.deepcopy(net)
    initial = {key: tensor.detach().clone() for key, tensor in ref.state_dict().items()}
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                bucket_mb=spec.get("bucket_mb", 25.0), **spec.get("options", {}))
    ref_optimizer = make_optimizer(ref, spec["optimizer"])
    if isinstance(ref_optimizer, list):
        ref_optimizer = se.optim.OptimizerList(ref_optimizer)
    schedulers = _schedulers(optimizer, spec) + _schedulers(ref_optimizer, spec)
    norms, ref_norms = train_side_by_side(spec, model, optimizer, ref, ref_optimizer,
                                          after_step=lambda: [scheduler.step() for scheduler in schedulers])
    result = compare_to_reference(model, ref, norms, ref_norms)
    result["muon_updates"] = _muon_updates(ref, ref_optimizer, initial)
    result["lrs"] = [group["lr"] for group in optimizer.param_groups]
    result["owners"] = owner_stats(model)
    return result


def _muon_updates(ref: nn.Module, ref_optimizer, initial: dict) -> dict:
    """For each matrix the reference's Muon stepped: its whole update, max |p - p0| over max |p|
    (the scale of the bf16 rounding allowance in [Note: Muon's tolerance])."""
    members = getattr(ref_optimizer, "optimizers", [ref_optimizer])
    stepped = {id(p) for member in members if isinstance(member, torch.optim.Muon)
               for group in member.param_groups for p in group["params"]}
    final = ref.state_dict(keep_vars=True)
    return {key: ((final[key].detach() - initial[key]).abs().max()
                  / final[key].detach().abs().max().clamp(min=1e-12)).item()
            for key in final if id(final[key]) in stepped}


def _schedulers(optimizer, spec: dict) -> list:
    """With ``spec['schedulers']``: one LR scheduler per member optimizer, each its own rule."""
    if not spec.get("schedulers"):
        return []
    members = getattr(optimizer, "optimizers", [optimizer])
    return [torch.optim.lr_scheduler.LambdaLR(member, lambda step, i=i: 1.0 / (1 + (i + 1) * step))
            for i, member in enumerate(members)]


def owner_stats(model) -> dict:
    """Which ranks step which whole-tensor parameters (names), from this rank's view."""
    engine = model.engine
    mine = [engine.params.name(b.params[piece.slot]) for b in engine.buckets if b.whole_tensor
            for piece in b.master_pieces]
    return {"stepped_here": sorted(mine), "group_rank": engine.comm.shard.rank,
            "group_size": engine.comm.group_size}


# --------------------------------------------------------------------------- fp16 overflow


def fp16_overflow_momentum(spec: dict) -> dict:
    """A step whose gradient overflows in fp16 is skipped: Muon's momentum stays finite and
    unchanged, the loss scale backs off, and the next step trains normally."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = MatrixNet(bias=False)
    model, optimizer = se.shard(net, torch.optim.Muon(net.parameters(), lr=0.02), stage=spec["stage"],
                                param_dtype="fp16", initial_loss_scale=2.0 ** 10)
    b = spec["per_rank_batch"]

    def step(scale_loss: float) -> None:
        ids, targets = batch(spec, 0, 0, world)
        mine = slice(rank * b, (rank + 1) * b)
        (F.cross_entropy(model(ids[mine]), targets[mine]) * scale_loss).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(1.0)
    before = _momenta(optimizer)
    scale_before = model.engine.scaler.scale
    step(1e30)  # inf in fp16 on every rank
    after = _momenta(optimizer)
    scale_after = model.engine.scaler.scale
    step(1.0)
    return {"finite": all(bool(torch.isfinite(m).all()) for m in after.values()),
            "unchanged": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
            "n_momenta": len(after), "scale_before": scale_before, "scale_after": scale_after,
            "finite_after_next": all(bool(torch.isfinite(m).all()) for m in _momenta(optimizer).values()),
            "params_finite": all(bool(torch.isfinite(t).all()) for t in model.full_state_dict().values())}


def _momenta(optimizer) -> dict:
    return {i: state["momentum_buffer"].clone() for i, state in enumerate(optimizer.state.values())
            if "momentum_buffer" in state}


# --------------------------------------------------------------------------- meta model at stage 3


def meta_shapes_stage3(spec: dict) -> dict:
    """A meta-device model at stage 3: Muon sees the real 2-D shapes and trains."""
    _single_thread()
    rank, world = rank_world()
    with torch.device("meta"):
        net = MatrixNet(bias=False)
    model, optimizer = se.shard(net, lambda params: torch.optim.Muon(params, lr=0.02), stage=3)
    shapes = sorted(tuple(p.shape) for group in optimizer.param_groups for p in group["params"])
    b = spec["per_rank_batch"]
    ids, targets = batch(spec, 0, 0, world)
    F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
    optimizer.step()
    stepped = sorted(tuple(p.shape) for p in optimizer.state)
    return {"shapes": shapes, "stepped": stepped,
            "finite": all(bool(torch.isfinite(t).all()) for t in model.full_state_dict().values())}


# --------------------------------------------------------------------------- checkpoints


def checkpoint_then_continue(spec: dict) -> dict:
    """Train ``spec['before']`` steps, save (or load and continue) a checkpoint, train on.

    ``spec['mode']``: "save" trains then saves at ``path``; "load" builds fresh, loads
    ``path`` and trains ``spec['after']`` steps; "straight" trains before + after steps
    without a checkpoint (the reference, any world size: the global batch is the same).
    """
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build(spec)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"])
    mode = spec["mode"]
    steps = {"save": range(spec["before"]), "load": range(spec["before"], spec["before"] + spec["after"]),
             "straight": range(spec["before"] + spec["after"])}[mode]
    if mode == "load":
        se.load_checkpoint(spec["path"], model, optimizer)
    # the global batch of 12 is cut into this world's equal slices
    global_batch = spec["global_batch"]
    b = global_batch // world
    for step in steps:
        ids, targets = batch({**spec, "per_rank_batch": global_batch}, step, 0, 1)
        mine = slice(rank * b, (rank + 1) * b)
        F.cross_entropy(model(ids[mine]), targets[mine]).backward()
        optimizer.step()
        optimizer.zero_grad()
    if mode == "save":
        se.save_checkpoint(spec["path"], model, optimizer, extra={"step": spec["before"]})
    full = model.full_state_dict()
    full_opt = model.full_optimizer_state_dict(optimizer)
    return {"state": full, "optimizer": full_opt}


def full_optimizer_state_roundtrip(spec: dict) -> dict:
    """``full_optimizer_state_dict`` per optimizer loads into plain torch optimizers over the
    unwrapped model, and back into the sharded one (same numbers after one more step)."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build(spec)
    plain = copy.deepcopy(net)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"])
    b = spec["per_rank_batch"]
    for step in range(2):
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        optimizer.step()
        optimizer.zero_grad()
    full = model.full_optimizer_state_dict(optimizer)
    plain.load_state_dict(model.full_state_dict())
    plain_optimizer = make_optimizer(plain, spec["optimizer"])
    members = plain_optimizer if isinstance(plain_optimizer, list) else \
        getattr(plain_optimizer, "optimizers", [plain_optimizer])
    parts = copy.deepcopy(full if isinstance(full, list) else [full])  # torch's loader keeps the tensors
    for member, part in zip(members, parts):
        member.load_state_dict(part)  # torch's own loader: the format is torch's
    model.load_full_optimizer_state_dict(optimizer, full)
    ids, targets = batch(spec, 2, 0, world)
    F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
    optimizer.step()
    plain_loss = F.cross_entropy(plain(ids), targets)
    plain_loss.backward()
    for member in members:
        member.step()
    return {"is_list": isinstance(full, list), "n_parts": len(parts),
            "classes": [type(m).__name__ for m in members], "state": model.full_state_dict(),
            "plain": {k: v.detach().clone() for k, v in plain.state_dict().items()}}


def tmp_dir_for(name: str) -> str:
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), name)


# --------------------------------------------------------------------------- misuse


class NormalizedSGD(torch.optim.Optimizer):
    """A whole-tensor optimizer the engine does not know: each update is the gradient
    divided by its matrix's Frobenius norm (wrong if stepped on slices)."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-group["lr"])


def train_declared(spec: dict) -> dict:
    """A user-declared whole-tensor optimizer (``whole_tensor_optimizers=``) against one process."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build({**spec, "optimizer": "muon"})
    ref = copy.deepcopy(net)
    model, optimizer = se.shard(net, NormalizedSGD(net.parameters()), stage=spec["stage"],
                                whole_tensor_optimizers=(NormalizedSGD,))
    ref_optimizer = NormalizedSGD(ref.parameters())
    b = spec["per_rank_batch"]
    for step in range(spec["steps"]):
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        F.cross_entropy(ref(ids), targets).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return compare_to_reference(model, ref, [], [])


def misuse_case(case: str) -> dict:
    """One wrong use; the exception's type and message (or None)."""
    _single_thread()
    torch.manual_seed(0)
    net = MatrixNet(wide=7)
    try:
        if case == "overlap":
            se.shard(net, [torch.optim.SGD(net.parameters(), lr=0.1),
                           torch.optim.AdamW(net.head.parameters())], stage=1)
        elif case == "unknown_class":
            se.shard(net, NormalizedSGD(net.parameters()), stage=2)
        elif case == "bad_declared":
            se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=1, whole_tensor_optimizers=("Muon",))
        elif case == "member_step":
            _, opts = se.shard(net, [torch.optim.SGD(net.blocks.parameters(), lr=0.1),
                                     torch.optim.AdamW(list(net.embed.parameters()) + list(net.head.parameters()))],
                               stage=2)
            opts.optimizers[0].step()
        elif case == "list_add_group":
            _, opts = se.shard(net, [torch.optim.SGD(net.blocks.parameters(), lr=0.1),
                                     torch.optim.AdamW(net.embed.parameters())], stage=1)
            opts.add_param_group({"params": list(net.head.parameters())})
        elif case == "not_an_optimizer":
            se.shard(net, [torch.optim.SGD(net.parameters(), lr=0.1), "adamw"], stage=1)
        else:
            raise ValueError(case)
    except Exception as error:  # noqa: BLE001 - the test asserts on it
        return {"type": type(error).__name__, "message": str(error),
                "is_config_error": isinstance(error, se.ConfigError)}
    return {"type": None, "message": ""}


def comm_of_step(spec: dict) -> dict:
    """Bytes counted for the second step against ``ring_model_bytes()``, with owner layouts."""
    _single_thread()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build(spec)
    model, optimizer = se.shard(net, make_optimizer(net, spec["optimizer"]), stage=spec["stage"],
                                **spec.get("options", {}))
    b = spec["per_rank_batch"]
    for step in range(2):  # the first step also agrees on the batch weights' reference
        model.reset_comm_stats()
        ids, targets = batch(spec, step, 0, world)
        F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        optimizer.step()
        optimizer.zero_grad()
    owner_buckets = sum(1 for bucket in model.engine.buckets if bucket.whole_tensor)
    return {"sent": sum(model.comm_stats().bytes_by_kind.values()), "ring_model": model.ring_model_bytes(1),
            "owner_buckets": owner_buckets}
