"""Rank workers: gradients reached through the optimizer rather than the model.

``optimizer.param_groups`` at stages >= 1 holds the master pieces, whose ``.grad``
exists only inside the step (flat/guard.py, [Note: the optimizer's pieces outside the
step]); ``optimizer.zero_grad()`` clears the gradients of the optimizer's parameters
only, as torch's does. Each worker trains the sharded model beside an unwrapped copy on
the global batch (see [Note: the reference] in engine_cases.py).
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools

import torch
import torch.nn.functional as F

from engine_cases import _single_thread, batch, rel_err
from fidelity_cases import _shard, outcome
from rank_pool import rank_world
from toy_models import build_model


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list:
    return list(itertools.chain(*[group["params"] for group in optimizer.param_groups]))


def _backward(model, ref, spec: dict, step: int) -> None:
    rank, world = rank_world()
    b = spec["per_rank_batch"]
    ids, targets = batch(spec, step, 0, world)
    F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
    F.cross_entropy(ref(ids), targets).backward()


def _max_error(model, ref) -> float:
    full = model.full_state_dict()
    return max(rel_err(full[k], v) for k, v in ref.state_dict().items())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def grads_through_the_optimizer(spec: dict) -> dict:
    """What torch's idioms over ``optimizer.param_groups`` do between backward and step, inside
    the step, after it, and after a step that raised; then that training still matches torch."""
    _single_thread()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    model, optimizer = _shard(spec, net, _adamw(net.parameters()))
    ref_optimizer = _adamw(ref.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, 1, gamma=0.5)
    params = _optimizer_params(optimizer)
    _backward(model, ref, spec, 0)
    results = {
        "clip_norm": outcome(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)),
        "clip_value": outcome(lambda: torch.nn.utils.clip_grad_value_(params, 1e9)),
        "read_grad": outcome(lambda: [p.grad for p in params]),
        "read_values": outcome(lambda: sum(float(p.detach().sum()) for p in params)),
    }
    in_backward = spec["options"].get("step_in_backward", False)  # stepped already; clipping refused
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    if not in_backward:
        results["norm_error"] = abs(float(model.clip_grad_norm_(1e9)) - ref_norm) / ref_norm
    inside = []  # a step pre-hook of the user's runs inside the step: gradients are there
    handle = optimizer.register_step_pre_hook(lambda *_: inside.append(outcome(lambda: [p.grad for p in params])))
    for opt, sched in ((optimizer, scheduler), (ref_optimizer, ref_scheduler)):
        opt.step()
        sched.step()
    handle.remove()
    results["inside_step"] = inside[0]
    results["after_step"] = outcome(lambda: [p.grad for p in params])
    results["zero_grad"] = outcome(optimizer.zero_grad)
    ref_optimizer.zero_grad()
    saved = io.BytesIO()
    results["state_dict"] = outcome(lambda: torch.save(optimizer.state_dict(), saved))
    results["load_state_dict"] = outcome(
        lambda: optimizer.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False)))
    _backward(model, ref, spec, 1)  # a step that raises inside (after the engine's pre-hook)
    handle = optimizer.register_step_pre_hook(lambda *_: 1 / 0)
    results["raising_step"] = outcome(optimizer.step)
    if in_backward:  # the step ran inside backward, before the hook raised
        ref_optimizer.step()
    handle.remove()
    results["after_raising_step"] = outcome(lambda: [p.grad for p in params])
    results["set_grad_none"] = outcome(lambda: [setattr(p, "grad", None) for p in params])
    optimizer.zero_grad()
    ref_optimizer.zero_grad()
    for step in (2, 3):
        _backward(model, ref, spec, step)
        if not in_backward:
            model.clip_grad_norm_(spec["max_norm"])
            torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["max_norm"])
        for opt, sched in ((optimizer, scheduler), (ref_optimizer, ref_scheduler)):
            opt.step()
            opt.zero_grad()
            sched.step()
    results["train_error"] = _max_error(model, ref)
    results["guarded_at_end"] = outcome(lambda: [p.grad for p in params])
    return results


def _window(model, ref, spec: dict, step: int) -> None:
    """One accumulation window: ``micro_steps`` backwards, all but the last under no_sync()."""
    rank, world = rank_world()
    b = spec["per_rank_batch"]
    for micro in range(spec["micro_steps"]):
        ids, targets = batch(spec, step, micro, world)
        quiet = model.no_sync() if micro < spec["micro_steps"] - 1 else contextlib.nullcontext()
        with quiet:
            F.cross_entropy(model(ids[rank * b:(rank + 1) * b]), targets[rank * b:(rank + 1) * b]).backward()
        F.cross_entropy(ref(ids), targets).backward()


def _summoned_grad_error(model, net, ref, prefix: str) -> float:
    with model.summon_full_params(with_grads=True):
        pairs = [(p.grad, r.grad) for (n, p), r in zip(net.named_parameters(), ref.parameters())
                 if n.startswith(prefix)]
        return max(float("inf") if g is None else rel_err(g, r) for g, r in pairs)


def grads_outside_the_optimizer(spec: dict) -> dict:
    """A trainable head outside the optimizer: its gradient accumulates across steps and
    ``optimizer.zero_grad()`` (with and without a step), as torch's; ``add_param_group`` then
    steps it with all of it; ``model.zero_grad()`` clears it."""
    _single_thread()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    body = [p for n, p in net.named_parameters() if not n.startswith("head")]
    model, optimizer = _shard(spec, net, _adamw(body))
    ref_optimizer = _adamw([p for n, p in ref.named_parameters() if not n.startswith("head")])
    both = (optimizer, ref_optimizer)
    _window(model, ref, spec, 0)
    for opt in both:
        opt.step()
        opt.zero_grad()
    _window(model, ref, spec, 1)
    for opt in both:  # a window discarded without a step: the head keeps its share
        opt.zero_grad()
    results = {"kept_grad_error": _summoned_grad_error(model, net, ref, "head")}
    for opt, head in zip(both, (net.head, ref.head)):
        opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
    for step in (2, 3):
        _window(model, ref, spec, step)
        for opt in both:
            opt.step()
            opt.zero_grad()
    results["train_error"] = _max_error(model, ref)
    _window(model, ref, spec, 4)
    model.zero_grad()
    ref.zero_grad()
    with model.summon_full_params(with_grads=True):
        results["cleared"] = all(p.grad is None or not p.grad.any() for p in net.parameters())
    return results
