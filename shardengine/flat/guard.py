"""Parameters whose full value or gradient this rank does not hold, made loud.

[Note: why a guard class]
At stage 3 a parameter's full value exists only while its unit is gathered;
at stages 1-3, once gradients are reduced, each rank holds only its slice of
them. A plain tensor would then show freed memory, zeros or a partial
gradient: ``print(p)``, ``p.sum()``, ``copy.deepcopy``, ``torch.save`` and
``torch.nn.utils.clip_grad_norm_(model.parameters())`` would run and give a
wrong answer (or read freed memory). Instead the engine swaps the
parameter's class to a guarded subclass for exactly those periods: its
``__torch_function__`` lets metadata through (shape, dtype, device,
requires_grad, hooks) and raises a :class:`ShardedAccessError` naming the
parameter and the way to do what the user wanted. Outside those periods the
class is swapped back, so forward and backward pay nothing.

A sharded (stage 3) parameter's storage is also re-pointed at a one-element
placeholder broadcast to its shape: even a path that bypasses
``__torch_function__`` reads zeros, never freed memory.

The engine itself reaches guarded parameters inside :func:`engine_access`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..errors import ShardedAccessError


# Reading these touches no element data: they stay allowed on a guarded parameter.
_METADATA_GETTERS = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "names",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize",
    "_backward_hooks", "_post_accumulate_grad_hooks", "output_nr", "_version", "_base", "is_mps",
    "is_xpu", "is_mtia", "nbytes", "__dict__"})
_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "is_contiguous", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "__len__", "get_device", "type_as", "is_signed", "__hash__", "_is_view", "stride",
    "storage_offset", "is_shared", "is_pinned", "has_names", "retain_grad"})


class GuardState:
    """Why a parameter is guarded, and what to tell the user."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sharded = False        # stage 3: the full value is not held
        self.grad_sharded = False   # stages 1-3: gradients were reduce-scattered
        self.stage = 0
        self.orphan: object = None  # the parameter itself, once its engine is gone (see _forget)
        # stage 3: gathers the parameter's unit where that is right (inside the model's forward or
        # backward: an "external" use, stages/external.py); True if it did
        self.gather_on_access: Optional[Callable[[], bool]] = None

    @property
    def active(self) -> bool:
        return self.sharded or self.grad_sharded

    def value_error(self) -> ShardedAccessError:
        return ShardedAccessError(
            f"parameter {self.name!r} is sharded (stage 3): between forward/backward passes this "
            "rank holds only its slice, so its full value cannot be read or written here. Use "
            "`with model.summon_full_params(): ...` to read or modify full values, "
            "model.state_dict() / model.full_state_dict() to save them, and cast or move the model "
            "before shard(), not after. (Inside the model's forward a parameter is gathered where it "
            "is used; a unit entered through a method other than forward, as in "
            "self.vit.forward_features(x), is gathered and freed around that call once registered: "
            "se.model.register_forward_method(module, 'forward_features').)")

    def sharded_access(self) -> None:
        """A read or write of the full value while this rank holds a slice: gather it where the
        engine may (see ``gather_on_access``), else a ShardedAccessError."""
        if self.gather_on_access is None or not self.gather_on_access():
            raise self.value_error()

    def grad_read_allowed(self) -> bool:
        return False

    def grad_error(self) -> ShardedAccessError:
        return ShardedAccessError(
            f"the gradient of {self.name!r} is sharded (stage {self.stage}): after backward each "
            "rank holds the averaged gradient of its own slice only, so p.grad is not the full "
            "gradient. Use model.clip_grad_norm_(max_norm) for clipping by the global norm "
            "(torch.nn.utils.clip_grad_norm_(model.parameters()) cannot see the other ranks' "
            "slices), or `with model.summon_full_params(with_grads=True): ...` to read full "
            "gradients.")


_ZERO_GRAD_CODE = inspect.unwrap(torch.optim.Optimizer.zero_grad).__code__


class PieceGuardState(GuardState):
    """An optimizer's tensor at stages >= 1 (flat/bucket.py ``MasterPiece``): this rank's fp32 master
    fragment of a parameter. Its value is readable; its ``.grad`` exists only inside the step.

    [Note: the optimizer's pieces outside the step]
    A rebuilt optimizer's param groups hold the master pieces, not the model's parameters, and the
    engine hands a piece its slice of the reduced gradient only for the optimizer's own step
    (stages/stepping.py ``before_step``) and drops it after. Between backward and step a piece's
    ``.grad`` is None, after the step it is gone again, and inside the step it is this rank's slice
    only: ``clip_grad_norm_`` over ``optimizer.param_groups`` (Lightning's and Accelerate's idiom)
    would return 0 or a rank-local norm and clip nothing. So a piece is guarded for its gradient
    always, except while the step runs (and during the engine's own steps inside backward): the
    class swap costs nothing in forward and backward, and reading it outside says what to call.
    """

    def __init__(self, name: str, replicated: bool) -> None:
        super().__init__(name)
        self.replicated = replicated  # stage 0: the piece is a whole fp32 master, not a slice
        self.grad_sharded = True

    def grad_read_allowed(self) -> bool:
        """torch's own ``Optimizer.zero_grad`` reads the pieces' ``.grad`` (None outside the step)
        also where a wrapper calls the class's method past the engine's (Fabric's optimizer
        subclasses the user's class): nothing is lost by letting it. Looked up only on the error
        path, a few frames up (this method, ``_check_access``, ``__torch_function__``, the reader)."""
        frame = sys._getframe(1)
        for _ in range(4):
            if frame is None:
                return False
            if frame.f_code is _ZERO_GRAD_CODE:
                return True
            frame = frame.f_back
        return False

    def grad_error(self) -> ShardedAccessError:
        held = "an fp32 master copy of" if self.replicated else "this rank's slice of"
        return ShardedAccessError(
            f"the optimizer's param_groups hold {held} each parameter (here {self.name}), not the "
            "model's parameters; the engine gives it its part of the reduced gradient only inside "
            "optimizer.step(), so its .grad cannot be read or clipped outside the step (a norm over it "
            "would be 0 or this rank's alone). Use model.clip_grad_norm_(max_norm) to clip by the "
            "global norm (it returns that norm; model.clip_grad_norm_(float('inf')) only measures it), "
            "and `with model.summon_full_params(with_grads=True): ...` over model.parameters() to read "
            "or edit full gradients (e.g. clip_grad_value_).")


def _attribute_name(func: Any) -> Optional[str]:
    """``"grad"`` for the getter/setter of ``Tensor.grad`` and the like, else None."""
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) if getattr(func, "__name__", "") in ("__get__", "__set__") else None


# id(param) -> its guard state. Kept outside the tensor so that copies, pickles and
# torch.save never carry it, and without a weak reference to it (torch.utils.swap_tensors,
# used to materialize meta parameters, refuses weakly referenced tensors). Only instances
# of a guarded class are looked up, and only the engine makes those: an entry outliving
# its parameter is never consulted for another object.
_STATES: dict[int, GuardState] = {}


def state_of(param: torch.Tensor) -> Optional[GuardState]:
    return _STATES.get(id(param))


class _Guarded:
    """Mixin of the guarded parameter classes (see the module note)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch.nn.init and torch's keyword forms (torch.sum(input=p)) pass the parameter by name
        for state in _guard_states((*args, *kwargs.values())):
            _check_access(state, func, args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A plain parameter with this rank's values (no gradient, as torch copies)."""
        state = _STATES[id(self)]
        if state.sharded:
            raise state.value_error()
        with engine_access():
            copied = plain_class(self)(self.data.clone(memory_format=torch.preserve_format),
                                       self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        state = _STATES[id(self)]
        if state.sharded:
            raise state.value_error()
        with engine_access():
            return (nn.Parameter, (self.data.clone(), self.requires_grad))


def _guard_states(args) -> Iterator[GuardState]:
    for arg in args:
        if isinstance(arg, _Guarded):
            state = _STATES.get(id(arg))
            if state is not None:
                yield state
        elif isinstance(arg, (list, tuple)):
            yield from _guard_states(arg)


def _check_access(state: GuardState, func, args) -> None:
    attribute = _attribute_name(func)
    if attribute is not None:
        if attribute == "grad":
            setting_none = func.__name__ == "__set__" and len(args) > 1 and args[1] is None
            if state.grad_sharded and not setting_none and not state.grad_read_allowed():
                raise state.grad_error()
            return
        if attribute in _METADATA_GETTERS and func.__name__ == "__get__":
            return
        if state.sharded:
            state.sharded_access()
        return
    if getattr(func, "__name__", None) in _METADATA_METHODS:
        return
    if state.sharded:
        state.sharded_access()


_GUARDED_CLASSES: dict[type, type] = {}


def _guarded_class(cls: type) -> type:
    """The guarded subclass of a parameter class (made once per class)."""
    if issubclass(cls, _Guarded):
        return cls
    if cls not in _GUARDED_CLASSES:
        _GUARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (_Guarded, cls), {"_plain_class": cls})
    return _GUARDED_CLASSES[cls]


def plain_class(param: nn.Parameter) -> type:
    return getattr(type(param), "_plain_class", type(param))


def attach(param: nn.Parameter, name: str, stage: int) -> GuardState:
    """Give ``param`` a guard state (inactive until :func:`refresh`)."""
    state = GuardState(name)
    state.stage = stage
    _STATES[id(param)] = state
    return state


def refresh(param: nn.Parameter) -> None:
    """Swap ``param``'s class to match its guard state (guarded only while active)."""
    state = _STATES.get(id(param))
    if state is None:
        return
    wanted = _guarded_class(plain_class(param)) if state.active else plain_class(param)
    if type(param) is not wanted:
        param.__class__ = wanted


def set_grad_sharded(params, sharded: bool) -> None:
    for param in params:
        state = _STATES.get(id(param))
        if state is not None and state.grad_sharded != sharded:
            state.grad_sharded = sharded
            refresh(param)


def attach_piece(piece: nn.Parameter, name: str, replicated: bool) -> None:
    """Guard an optimizer piece's gradient (see [Note: the optimizer's pieces outside the step]).
    Its entry goes with it: a piece is dropped when its bucket is re-split (stages/replan.py)."""
    _STATES[id(piece)] = PieceGuardState(name, replicated)
    weakref.finalize(piece, _STATES.pop, id(piece), None)
    refresh(piece)


@contextlib.contextmanager
def grads_open(params: list) -> Iterator[None]:
    """Inside: ``params``' gradients are plain to set and read (the optimizer's own step)."""
    set_grad_sharded(params, False)
    try:
        yield
    finally:
        set_grad_sharded(params, True)


def set_sharded(param: nn.Parameter, sharded: bool) -> None:
    state = _STATES.get(id(param))
    if state is not None and state.sharded != sharded:
        state.sharded = sharded
        refresh(param)


def detach_guard(param: nn.Parameter) -> None:
    """Forget the guard (a parameter leaving the engine, e.g. in a copy)."""
    state = _STATES.pop(id(param), None)
    if state is not None:
        param.__class__ = plain_class(param)


def forget_when_collected(engine: object, params: list) -> None:
    """Once ``engine`` is garbage-collected, its parameters leave the guard table.

    ``_STATES`` is keyed by ``id``; an entry outliving its parameter could be found
    again by a later parameter at the same address (and make it guarded with a
    dead engine's state). A parameter still sharded keeps its guard: its values are
    gone with the engine, and reading it must stay an error; its entry then holds it
    (a one-element placeholder), so that its address is never another parameter's.
    """
    weakref.finalize(engine, _forget, params)


def _forget(params: list) -> None:
    for param in params:
        state = _STATES.get(id(param))
        if state is None:
            continue
        if state.sharded:
            state.orphan = param
        else:
            detach_guard(param)


@contextlib.contextmanager
def engine_access() -> Iterator[None]:
    """The engine's own reads and writes of guarded parameters."""
    with torch._C.DisableTorchFunctionSubclass():
        yield


def placeholder_like(param: torch.Tensor) -> torch.Tensor:
    """A tensor of ``param``'s shape, dtype and device backed by one zero element."""
    return torch.zeros(1, dtype=param.dtype, device=param.device).expand(param.shape)
