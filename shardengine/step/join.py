"""``model.join()``: ranks with fewer batches keep serving the others' collectives.

[Note: joining]
Data-parallel ranks pair their collectives one for one, so a rank that runs
out of batches would leave the others waiting. Inside ``with model.join():``
every collective-bearing call of an *active* rank is first announced with the
step-sync vector (step/agreement.py): a training forward, a backward, a clip, an
optimizer step. A rank that leaves the ``with`` body has *joined*: it listens
to those announcements and plays its part in each with no data:

* backward: a micro-step of batch weight 0 (step/batch_weights.py), so it adds nothing to
  the sum and nothing to the divisor, but takes part in every reduction. At
  stages 0-2 the reductions do not depend on the model's graph, so an empty
  backward flushes them all; at stage 3 the gathers follow the model, so the
  rank replays its last forward (or, if it never ran one, the inputs an active
  rank sends once) and backpropagates zeros from the outputs that got
  gradients last time;
* clip and step: it runs them on its own shards with the active ranks'
  hyperparameters (a learning-rate schedule keeps moving), so the shards it
  owns get exactly the update they would have had.

When every rank has joined, all ranks leave together; the progress counters
are made equal again, and at stage 0 the replicas take the last active rank's
parameters and optimizer state (a joined rank cannot see a
``torch.nn.utils.clip_grad_norm_`` call made on the others).

Cost inside the context: one small all-reduce per forward, backward, clip and
step (the announcements), as DDP's ``Join`` pays one per iteration.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Iterator, Optional

import torch
from torch.utils._pytree import tree_map

from ..errors import CollectiveError
from .agreement import Announcement, Contribution, exchange
from ..flat.units import tensors_in
from ..engine_api import Engine
from .join_state import JoinState  # noqa: F401 - read from here too


# ---------------------------------------------------------------------- the context


@contextlib.contextmanager
def joining(engine: Engine) -> Iterator[None]:
    """``with model.join():`` (see the Note)."""
    state = engine.join_state
    if state.inside:
        raise RuntimeError("model.join() is already active on this rank; do not nest it")
    engine.failure.check_usable()
    state.inside, state.announced = True, 0
    try:
        yield
    except BaseException:
        state.inside = False
        if engine.comm.world_size > 1:
            try:  # the others are waiting for this rank's announcements: stop them now
                engine.failure.fail(f"an exception left model.join() on rank {engine.comm.rank}")
            except CollectiveError:
                pass  # the original exception is the one to show
        raise
    try:
        _serve_until_all_joined(engine)
        _reconcile(engine)
    finally:
        state.inside = state.serving = False
        state.last_inputs = state.grad_outputs = None
        state.replay_outputs = []


# ---------------------------------------------------------------------- active side


def announce(engine: Engine, kind: Announcement, flag: bool = False, aux: tuple[float, float] = (0.0, 0.0),
             template: Optional[tuple[tuple, dict]] = None) -> None:
    """An active rank tells joined ranks what comes next (a no-op outside join())."""
    state = engine.join_state
    if not state.announcing or engine.comm.world_size == 1:
        return
    values = hyperparameters(engine.optimizer)  # sent with a step; zeros keep the vector's width
    extra = values if kind is Announcement.STEP else (0.0,) * len(values)
    agreement = exchange(engine.comm, Contribution(engine.counters, bytearray(), kind, flag=flag, aux=aux,
                                                   extra=extra), engine.forward.sync_device())
    state.announced += 1
    if agreement.needs_template:
        payload = None
        if template is not None:
            payload = (tree_map(_to_cpu, template), state.grad_outputs)
        engine.comm.all_gather_object(payload)


def note_inputs(engine: Engine, args: tuple, kwargs: dict) -> None:
    """Stage 3: keep the training forward's inputs, which a joined rank replays."""
    if engine.join_state.inside and engine.spec.forward_communicates:
        engine.join_state.last_inputs = (args, kwargs)


def note_outputs(engine: Engine, tensors: list[torch.Tensor]) -> None:
    """Stage 3: record which outputs backward reaches (the replay starts from those)."""
    state = engine.join_state
    if not (state.announcing and engine.spec.forward_communicates):
        return
    state._noted_outputs = []
    for index, tensor in enumerate(tensors):
        if tensor.requires_grad:
            tensor.register_hook(lambda grad, index=index: state._noted_outputs.append(index))


def backward_done(engine: Engine) -> None:
    state = engine.join_state
    if state.announcing and state._noted_outputs:
        state.grad_outputs = sorted(set(state._noted_outputs))


# ---------------------------------------------------------------------- joined side


def _serve_until_all_joined(engine: Engine) -> None:
    state = engine.join_state
    if engine.comm.world_size == 1:
        return
    state.serving = True
    width = len(hyperparameters(engine.optimizer))
    while True:
        needs = engine.spec.forward_communicates and state.last_inputs is None
        agreement = exchange(engine.comm, Contribution(engine.counters, bytearray(), active=False,
                                                       needs_template=needs, extra=(0.0,) * width),
                             engine.forward.sync_device())
        if agreement.active_ranks == 0:
            return  # every rank has joined: all leave at this same exchange
        if agreement.needs_template:
            _receive_template(engine, engine.comm.all_gather_object(None))
        _serve(engine, agreement)


def _serve(engine: Engine, agreement) -> None:
    kind = agreement.kind
    if kind == Announcement.FORWARD:
        _serve_forward(engine, grad_enabled=agreement.flag)
    elif kind == Announcement.BACKWARD:
        _serve_backward(engine, reduces=agreement.flag, window_fresh=agreement.aux[0] > 0.5)
    elif kind == Announcement.CLIP:
        engine.stepping.clip_grad_norm_(agreement.aux[0], agreement.aux[1])
    elif kind == Announcement.STEP:
        set_hyperparameters(engine.optimizer, agreement.extra)
        engine.optimizer.step()
    else:
        raise CollectiveError(f"model.join(): unknown announcement kind {kind} from the active ranks")


def _receive_template(engine: Engine, payloads: list) -> None:
    sent = next((payload for payload in payloads if payload is not None), None)
    if sent is None:
        return  # sent with a forward only; a backward without one is refused in _replay_roots
    device = engine.forward.sync_device()
    inputs, outputs = sent
    engine.join_state.last_inputs = tree_map(lambda x: x.to(device) if torch.is_tensor(x) else x, inputs)
    engine.join_state.grad_outputs = outputs


def _serve_forward(engine: Engine, grad_enabled: bool) -> None:
    engine.weights.set(0.0)
    if not engine.spec.forward_communicates:  # only stage 3's forward has collectives to serve
        if engine.weights.needs_reference:
            engine.forward.agree_first_reference()
        return
    state = engine.join_state
    args, kwargs = state.last_inputs
    buffers = [buffer.detach().clone() for buffer in engine.module.buffers()]
    with torch.set_grad_enabled(grad_enabled):
        output = engine.module(*args, **kwargs)
    with torch.no_grad():  # a replayed batch must not move BatchNorm statistics
        for buffer, saved in zip(engine.module.buffers(), buffers):
            buffer.copy_(saved)
    state.replay_outputs = list(tensors_in(output)) if grad_enabled else []


def _serve_backward(engine: Engine, reduces: bool, window_fresh: bool) -> None:
    if window_fresh and any(not bucket.window_fresh for bucket in engine.buckets):
        engine.window.zero_grad(set_to_none=False, by_user=False)  # the active ranks started a new window without a step
    engine.weights.set(0.0)
    try:
        with engine.syncing(reduces):
            roots = _replay_roots(engine) if engine.spec.forward_communicates else []
            if not roots:  # an empty backward: the engine's hooks run and flush every reduction
                roots = [torch.zeros((), requires_grad=True)]
                engine.forward.hook_outputs(roots[0])
            torch.autograd.backward(roots, [torch.zeros_like(root) for root in roots])
    finally:
        engine.join_state.replay_outputs = []


def _replay_roots(engine: Engine) -> list[torch.Tensor]:
    state = engine.join_state
    outputs = state.replay_outputs
    if not outputs:
        raise CollectiveError("model.join(): the active ranks ran a backward at stage 3 whose "
                              "forward was not inside model.join(); run the forward inside it")
    chosen = state.grad_outputs if state.grad_outputs is not None else range(len(outputs))
    return [outputs[i] for i in chosen if i < len(outputs) and outputs[i].requires_grad]


# ---------------------------------------------------------------------- after everyone joined


def _reconcile(engine: Engine) -> None:
    """Equal counters again; at stage 0, the last active rank's replicas for everyone."""
    if engine.comm.world_size == 1:
        return
    everyone = engine.comm.all_gather_object((engine.counters.as_tuple(), engine.join_state.announced))
    counts = [max(values[i] for values, _ in everyone) for i in range(3)]
    engine.counters.catch_up(*counts)
    announced = [made for _, made in everyone]
    if engine.spec.steps_whole and len(set(announced)) > 1:  # stage 0: no all-gather re-syncs replicas
        last_active = announced.index(max(announced))
        engine.stepping.broadcast_replicas(src=last_active)


# ---------------------------------------------------------------------- hyperparameters


def hyperparameters(optimizer: Optional[torch.optim.Optimizer]) -> tuple[float, ...]:
    """The param groups' numeric hyperparameters (lr, betas, ...) as one flat tuple."""
    if optimizer is None:
        return ()
    values: list[float] = []
    for group in optimizer.param_groups:
        for key in _numeric_keys(group):
            value = group[key]
            values.extend(float(v) for v in (value if isinstance(value, tuple) else (value,)))
    return tuple(values)


def hyperparameter_digest(optimizer: Optional[torch.optim.Optimizer]) -> float:
    """One number that differs when any hyperparameter does (position-weighted sum)."""
    return sum((index + 1) * value for index, value in enumerate(hyperparameters(optimizer)))


def set_hyperparameters(optimizer: torch.optim.Optimizer, values: list[float]) -> None:
    """Take the active ranks' hyperparameters (see :func:`hyperparameters`)."""
    at = 0
    for group in optimizer.param_groups:
        for key in _numeric_keys(group):
            value = group[key]
            width = len(value) if isinstance(value, tuple) else 1
            taken = [type(v)(x) for v, x in zip(value if isinstance(value, tuple) else (value,),
                                                 values[at:at + width])]
            group[key] = tuple(taken) if isinstance(value, tuple) else taken[0]
            at += width


def _numeric_keys(group: dict) -> list[str]:
    def numeric(value: Any) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)

    return [key for key in sorted(group) if key not in ("params", "param_names")
            and (numeric(group[key]) or (isinstance(group[key], tuple) and group[key]
                                         and all(numeric(v) for v in group[key])))]


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if torch.is_tensor(value) else value
