"""A meta-device model materialized at stage 3, initialized as it would be on a real device.

[Note: meta init, unit by unit]
On a real device a model's weights come from init rules applied to every
submodule in ``module.apply`` order (children before their parent). A rule
may live on a parent: Hugging Face's T5 initializes the attention projections
from ``T5Attention``, GPT-2 rescales ``c_proj`` from the attention and MLP
modules, and ``post_init`` reaches modules that own no parameters directly.
At stage 3 only one unit has real storage at a time, so for each unit the
engine calls the rule on every module whose subtree holds one of the unit's
meta tensors, in ``apply`` order, while every other parameter is swapped for
a meta stand-in: a rule writing there does nothing now and takes effect in the
turn of the unit that owns it. Rules on disjoint tensors commute, so every
tensor gets the distribution a real-device init gives it (the random stream,
and so the exact values, differ).

[Note: every tensor filled, or a clear error]
The tensors to fill start as NaN (integers: their dtype's minimum). Any that
still holds it after the rules ran was covered by no rule, and the error names
it, its module, and what to do, instead of training from zeros or garbage.
Buffers on meta (rotary ``inv_freq`` and other non-persistent buffers computed
in ``__init__``) are filled the same way: Hugging Face's ``_init_weights``
recomputes them; for other models, build under :func:`meta_parameters`
(parameters on meta, buffers real), or fill them in ``param_init_fn``.

The default rule: a Hugging Face ``PreTrainedModel`` uses its own
``_init_weights`` (a sub-model's own, as ``post_init`` dispatches it; found
below a wrapper too, e.g. a PEFT model's ``base_model.model``); any other module
its ``reset_parameters()``. PEFT LoRA adapters are drawn as peft draws them
(``flat/adapter_init.py``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ..errors import ConfigError
from .adapter_init import copy_drawn, draw_adapters
from .quantized import meta_stand_in, source_of

InitFn = Callable[[nn.Module], None]


# =========================================================================== the rules


def meta_parameters() -> contextlib.AbstractContextManager:
    """Build modules with parameters on the meta device and buffers real (a CPU skeleton).

    Buffers computed in ``__init__`` (rotary ``inv_freq``, masks) keep their
    values, so stage 3 only has to initialize parameters; the parameters
    take no memory until :func:`shardengine.shard` materializes them unit by unit.

    >>> with meta_parameters():
    ...     bn = torch.nn.BatchNorm1d(4)
    >>> bn.weight.is_meta, bn.running_var.is_meta
    (True, False)
    """
    return _parameters_on_meta()


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def hf_init_fn(root: nn.Module) -> Optional[InitFn]:
    """Hugging Face's own init for a model holding a ``PreTrainedModel``, else None.

    Each module gets the ``_init_weights`` of its nearest ``PreTrainedModel``
    (itself or an ancestor), as ``post_init`` dispatches it through composite
    models. The ``PreTrainedModel`` may sit below the root (a PEFT model's
    ``base_model.model``); modules outside every one get ``reset_parameters()``.
    transformers is only looked at when it is imported.
    """
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if pretrained is None:
        return None
    owner_of: dict[int, Optional[nn.Module]] = {}

    def visit(module: nn.Module, owner: Optional[nn.Module]) -> None:
        owner = module if isinstance(module, pretrained) else owner
        owner_of[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(root, None)
    models = [m for m in root.modules() if isinstance(m, pretrained)]
    if not models:
        return None

    def init(module: nn.Module) -> None:
        owner = owner_of.get(id(module))
        with torch.no_grad():
            if owner is None:
                reset_parameters(module)
            else:
                owner._init_weights(module)

    init.hf_model_class = type(models[0]).__name__  # type: ignore[attr-defined]
    return init


def reset_parameters(module: nn.Module) -> None:
    """torch's convention: a module re-initializes its own tensors in ``reset_parameters()``."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def resolve_init_fn(root: nn.Module, param_init_fn: Optional[InitFn]) -> InitFn:
    """The rule to apply: the user's, else the model's own (Hugging Face), else ``reset_parameters``."""
    return param_init_fn or hf_init_fn(root) or reset_parameters


def check_initializable(root: nn.Module, param_init_fn: Optional[InitFn]) -> None:
    """Refuse before anything is allocated when the default rule cannot reach a meta tensor.

    Only the ``reset_parameters()`` default can be judged up front: a meta
    tensor held by a module with no ``reset_parameters()`` on itself or any
    ancestor. User rules and Hugging Face's are checked after each unit.
    """
    if param_init_fn is not None or hf_init_fn(root) is not None:
        return
    unreachable, buffers = [], False

    def visit(prefix: str, module: nn.Module, covered: bool) -> None:
        nonlocal buffers
        covered = covered or hasattr(module, "reset_parameters")
        own = [(name, t, False) for name, t in module._parameters.items()]
        own += [(name, t, True) for name, t in module._buffers.items()]
        for name, tensor, is_buffer in own:
            if not covered and tensor is not None and tensor.is_meta:
                kind = "buffer " if is_buffer else ""
                unreachable.append(f"{kind}{prefix + '.' if prefix else ''}{name} ({type(module).__name__})")
                buffers = buffers or is_buffer
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child, covered)

    visit("", root, False)
    if unreachable:
        hint = (". A buffer computed in __init__ has no value on meta: build the model under "
                "shardengine.model.meta_parameters() (parameters on meta, buffers real)") if buffers else ""
        raise ConfigError(
            f"stage 3 cannot initialize the meta-device tensors {_listed(unreachable)}: neither their "
            "modules nor any parent has reset_parameters(). Pass param_init_fn=fn (called on every "
            f"submodule, children first, as module.apply does){hint}")


def check_meta_model(root: nn.Module) -> None:
    """Meta parameters must be swappable (see [Note: meta init, unit by unit]): no weak references."""
    held = [name for name, p in root.named_parameters() if p.is_meta and weakref.getweakrefs(p)]
    if held:
        raise ConfigError(f"meta-device parameters {_listed(held)} are weakly referenced elsewhere; "
                          "stage 3 must replace their storage in place. Drop those references first")


# =========================================================================== one unit


class MetaInit:
    """How one :func:`shardengine.shard` call fills its meta tensors: checked before anything is
    allocated, then applied unit by unit (:meth:`initialize_unit`).

    With the default rules, PEFT LoRA adapters on meta are drawn up front as peft
    draws them (``flat/adapter_init.py``) and written after the rule on their module.
    """

    def __init__(self, root: nn.Module, param_init_fn: Optional[InitFn]):
        check_initializable(root, param_init_fn)
        self.root = root
        self.param_init_fn = param_init_fn
        self.adapters = draw_adapters(root) if param_init_fn is None else {}

    def initialize_unit(self, unit_module: nn.Module, meta_params: set[int], device: torch.device) -> None:
        """Fill one unit's tensors that were on meta (see :func:`_fill_unit`)."""
        _fill_unit(self.root, unit_module, meta_params, self.param_init_fn, device, self.adapters)


def _fill_unit(root: nn.Module, unit_module: nn.Module, meta_params: set[int],
               param_init_fn: Optional[InitFn], device: torch.device,
               adapters: dict[int, torch.Tensor]) -> None:
    """Fill one unit's tensors that were on meta: ``meta_params`` (ids; they have real
    storage now) and the meta buffers below ``unit_module`` (allocated here on ``device``).
    ``adapters``: values drawn up front (``id(param) -> value``), written after the rule
    on the module owning them, and dropped once written."""
    buffers = _materialize_buffers(root, unit_module, device)
    _materialize_empty_params(unit_module, device)
    targets = [p for p in root.parameters() if id(p) in meta_params and source_of(p) is None] + buffers
    with torch.no_grad():  # quantized codes: written by se.load_pretrained, zeros until then
        for param in unit_module.parameters():
            if id(param) in meta_params and source_of(param) is not None:
                param.zero_()
    if not targets:
        return
    init_fn = resolve_init_fn(root, param_init_fn)
    versions = {id(t): t._version for t in targets}
    with torch.no_grad():
        for tensor in targets:
            _fill_sentinel(tensor)
    target_ids = {id(t) for t in targets}
    others = [p for p in root.parameters() if id(p) not in target_ids and p.numel() > 0
              and (not p.is_meta or source_of(p) is not None)]
    with _swapped_for_meta(others):
        for name, module in _apply_order(root, target_ids):
            _call(init_fn, name, module)
            if adapters:
                copy_drawn(module, adapters)
    unfilled = [t for t in targets if _unfilled(t, versions[id(t)])]
    if unfilled:
        raise ConfigError(_unfilled_message(root, unfilled, param_init_fn, init_fn))


def _apply_order(root: nn.Module, targets: set[int]) -> list[tuple[str, nn.Module]]:
    """Modules in ``root.apply`` order (children first), each once, whose subtree holds a target."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> bool:
        own = list(module._parameters.values()) + list(module._buffers.values())
        hit = any(t is not None and id(t) in targets for t in own)
        for child_name, child in module.named_children():
            hit = visit(f"{name}.{child_name}" if name else child_name, child) or hit
        if hit and id(module) not in seen:
            seen.add(id(module))
            order.append((name, module))
        return hit

    visit("", root)
    return order


def _call(init_fn: InitFn, name: str, module: nn.Module) -> None:
    try:
        init_fn(module)
    except Exception as error:  # noqa: BLE001 - say which module, keep the cause
        raise ConfigError(f"initializing module {name or '<root>'} ({type(module).__name__}) of a "
                          f"meta-device model failed: {type(error).__name__}: {error}. The init "
                          "function is called on every submodule, children first (as module.apply "
                          "does)") from error


@contextlib.contextmanager
def _swapped_for_meta(params: list[nn.Parameter]) -> Iterator[None]:
    """Within the block, each of ``params`` holds a meta tensor (same object, shape, dtype):
    other units' storage is freed, and writing into it would crash the process."""
    swapped: list[tuple[nn.Parameter, nn.Parameter]] = []
    try:
        for param in params:
            stand_in = meta_stand_in(param)
            torch.utils.swap_tensors(param, stand_in)
            swapped.append((param, stand_in))
        yield
    finally:
        for param, stand_in in reversed(swapped):
            torch.utils.swap_tensors(param, stand_in)


def _materialize_buffers(root: nn.Module, unit_module: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Real (sentinel-filled later) tensors for the meta buffers below ``unit_module``,
    put in every module that registers them."""
    fresh: dict[int, torch.Tensor] = {}
    for module in unit_module.modules():
        for buffer in module._buffers.values():
            if buffer is not None and buffer.is_meta and id(buffer) not in fresh:
                fresh[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    if fresh:
        for module in root.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) in fresh:
                    module._buffers[name] = fresh[id(buffer)]
    return list(fresh.values())


def _materialize_empty_params(unit_module: nn.Module, device: torch.device) -> None:
    """Zero-element meta parameters hold nothing and are in no bucket: give them real storage."""
    from .bucket import point_param_at
    for param in unit_module.parameters():
        if param.is_meta and param.numel() == 0:
            point_param_at(param, torch.empty(param.shape, dtype=param.dtype, device=device))


# =========================================================================== filled or not


def _fill_sentinel(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)
    # bool: any write counts (see _unfilled)


def _unfilled(tensor: torch.Tensor, version_before: int) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool:
        return tensor._version == version_before
    return bool((tensor == torch.iinfo(tensor.dtype).min).any())


def _unfilled_message(root: nn.Module, unfilled: list[torch.Tensor], param_init_fn, init_fn) -> str:
    described = []
    for tensor in unfilled:
        name, module = _holder(root, tensor)
        kind = "buffer " if not isinstance(tensor, nn.Parameter) else ""
        described.append(f"{kind}{name} ({type(module).__name__})")
    if param_init_fn is not None:
        why = "param_init_fn left them unfilled (it must fill every tensor, or fill them from a parent)"
    elif init_fn is reset_parameters:
        why = ("no reset_parameters() fills them; pass param_init_fn=fn (called on every submodule, "
               "children first, as module.apply does)")
    else:
        why = (f"the model's own _init_weights ({init_fn.hf_model_class}) does not cover them; "
               "pass param_init_fn=fn")
    hint = ""
    if any(not isinstance(t, nn.Parameter) for t in unfilled):
        hint = (". A buffer computed in __init__ has no value on meta: build the model under "
                "shardengine.model.meta_parameters() (parameters on meta, buffers real), or fill it in param_init_fn")
    return (f"stage 3 materialized a meta-device model, but nothing initialized {_listed(described)}: "
            f"{why}{hint}")


def _holder(root: nn.Module, tensor: torch.Tensor) -> tuple[str, nn.Module]:
    """The qualified name of ``tensor`` and the first module registering it."""
    for prefix, module in root.named_modules(remove_duplicate=False):
        for name, own in list(module._parameters.items()) + list(module._buffers.items()):
            if own is tensor:
                return (f"{prefix}.{name}" if prefix else name), module
    return "?", root


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
