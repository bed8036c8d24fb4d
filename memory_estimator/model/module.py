"""Counting and tracing a ``torch.nn.Module`` without allocating its weights.

The module is built under ``torch.device("meta")``: tensors carry shapes and dtypes but
no storage, so a 1.5B-parameter model costs kilobytes. One forward+backward then runs
on meta tensors under :class:`LiveBytesTracker`, which adds up the storage each op
creates and subtracts it when Python frees it, giving peak live bytes.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import EstimatorInputError
from .stats import ModelStats, factored_numel
from .module_shape import module_architecture
from .traced_blocks import TracedActivations, UnitRecorder

ModuleSource = Union[nn.Module, Callable[[], nn.Module], str]
# (micro_batch, seq_len) -> an args tuple, one tensor, a dict of keyword arguments
# (``input_ids=..., labels=...``: a Hugging Face model then returns its own loss), or
# an ``(args, kwargs)`` pair.
ExampleInputs = Callable[[int, int], Any]


@dataclass(frozen=True)
class LoadedModule:
    """A module built on the meta device, plus the example-input maker if one was found."""

    module: nn.Module
    example_inputs: ExampleInputs | None


def _import_factory(spec: str) -> tuple[Callable[[], nn.Module], ExampleInputs | None]:
    """Resolve ``"package.module:build_fn"`` or ``"path/to/file.py:build_fn"``.

    The current directory is importable (as ``python -c`` would make it), so a factory
    file next to the training script works without installing anything. The module
    may define ``example_inputs(micro_batch, seq_len)``.
    """
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise EstimatorInputError(f"module spec {spec!r} must look like package.module:build_fn "
                                  "or path/to/file.py:build_fn")
    try:
        python_module = _import(module_name)
    except ImportError as error:
        raise EstimatorInputError(f"cannot import {module_name!r}: {error}") from None
    except SyntaxError as error:
        raise EstimatorInputError(f"cannot import {module_name!r}: syntax error at line {error.lineno}") from None
    factory = getattr(python_module, attribute, None)
    if not callable(factory):
        raise EstimatorInputError(f"{module_name!r} has no callable {attribute!r}")
    return factory, getattr(python_module, "example_inputs", None)


def _import(name: str):
    """Import a dotted module name, or a ``.py`` file by path."""
    import os
    import sys

    if name.endswith(".py"):
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise ImportError(f"no such file {name}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        python_module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))  # the file's own imports resolve beside it
        try:
            spec.loader.exec_module(python_module)
        finally:
            sys.path.remove(os.path.dirname(path))
        return python_module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(name)


def load_module(source: ModuleSource, example_inputs: ExampleInputs | None = None) -> LoadedModule:
    """Build the module on the meta device (an existing module is moved to meta, not copied)."""
    found_inputs = None
    if isinstance(source, str):
        source, found_inputs = _import_factory(source)
    if isinstance(source, nn.Module):
        module = source if _is_meta(source) else _meta_copy(source)
    elif callable(source):
        with torch.device("meta"):
            module = source()
        if not isinstance(module, nn.Module):
            raise EstimatorInputError(f"module factory returned {type(module).__name__}, not an nn.Module")
    else:
        raise EstimatorInputError(f"module must be an nn.Module, a factory or 'pkg.mod:fn', got {type(source).__name__}")
    return LoadedModule(module, example_inputs or found_inputs)


def _is_meta(module: nn.Module) -> bool:
    return all(p.is_meta for p in module.parameters())


def _meta_copy(module: nn.Module) -> nn.Module:
    """A structural copy whose tensors are meta twins; the caller's module is untouched.

    Deep-copying the real module would duplicate its weights first, so the memo maps
    every parameter and buffer to its meta twin up front; tied weights map to one twin.
    """
    memo: dict[int, Any] = {}
    for _, parameter in module.named_parameters(remove_duplicate=False):
        memo.setdefault(id(parameter), nn.Parameter(parameter.detach().to("meta"),
                                                    requires_grad=parameter.requires_grad))
    for _, buffer in module.named_buffers(remove_duplicate=False):
        memo.setdefault(id(buffer), buffer.detach().to("meta"))
    return copy.deepcopy(module, memo)


def unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters deduplicated by identity and by storage, so tied weights count once."""
    seen_ids: set[int] = set()
    seen_storages: set[tuple[int, int, tuple[int, ...]]] = set()
    unique = []
    for _, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in seen_ids:
            continue
        seen_ids.add(id(parameter))
        if not parameter.is_meta:
            # Two Parameter objects viewing one storage (manual tying) are one tensor.
            key = (parameter.untyped_storage().data_ptr(), parameter.storage_offset(), tuple(parameter.shape))
            if key in seen_storages:
                continue
            seen_storages.add(key)
        unique.append(parameter)
    return unique


def count_parameters(module: nn.Module) -> int:
    """Unique parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in unique_parameters(module))


def _unit_roots(module: nn.Module) -> list[nn.Module]:
    """Modules stage 3 would gather as one unit: every element of a ModuleList/Sequential
    of blocks, and every other child subtree that holds no such list."""
    units: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 1:
            units.extend(child)
        elif any(isinstance(m, (nn.ModuleList, nn.Sequential)) for m in child.modules()):
            units.extend(_unit_roots(child))
        else:
            units.append(child)
    return units


def largest_unit_params(module: nn.Module) -> int:
    """Largest unit's unique parameter count; parameters owned by no unit form one more."""
    total = count_parameters(module)
    units = _unit_roots(module)
    unit_sizes = [count_parameters(unit) for unit in units]
    leftover = total - sum(unit_sizes)
    return max(unit_sizes + [leftover]) if units else total


def module_stats(module: nn.Module) -> ModelStats:
    parameters = unique_parameters(module)
    return ModelStats(
        params=sum(p.numel() for p in parameters),
        largest_unit=largest_unit_params(module),
        factored_state_numel=sum(factored_numel(tuple(p.shape)) for p in parameters),
        source="module",
        largest_tensor=max((p.numel() for p in parameters), default=0),
        timing_shape=module_architecture(module),
    )


class LiveBytesTracker(TorchDispatchMode):
    """Peak bytes of tensor storage created inside the context and still referenced.

    Every op output's storage is counted once when first seen and released by a weakref
    callback when Python drops the last reference; views share their base's storage.
    Storages that already existed (an op's inputs the tracker never saw created, such as
    the parameters) are remembered as external, so a view of a weight (``weight.t()`` in
    a Linear) is not counted as a new allocation.
    """

    def __init__(self, on_output: Callable[[str, int, int], None] | None = None,
                 on_live: Callable[[int], None] | None = None) -> None:
        """``on_output(op name, storage key, bytes)`` hears of each storage an op creates,
        ``on_live(bytes)`` of the live bytes after it."""
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tracked: dict[int, weakref.ref] = {}
        self._external: dict[int, weakref.ref] = {}
        self._on_output = on_output
        self._on_live = on_live

    def tracks(self, key: int) -> bool:
        """Whether the storage with this key was created inside the context and is alive."""
        return key in self._tracked

    def _track(self, tensor: torch.Tensor, func=None) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._tracked or key in self._external:
            return
        size = storage.nbytes()
        self._tracked[key] = weakref.ref(storage, lambda _ref, key=key, size=size: self._release(key, size))
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self._on_output is not None and func is not None:
            self._on_output(func.overloadpacket.__name__, key, size)
        if self._on_live is not None:
            self._on_live(self.live_bytes)

    def _release(self, key: int, size: int) -> None:
        if self._tracked.pop(key, None) is not None:
            self.live_bytes -= size

    def _note_external(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._tracked and key not in self._external:
            self._external[key] = weakref.ref(storage, lambda _ref, key=key: self._external.pop(key, None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, torch.Tensor):
                self._note_external(value)
        output = func(*args, **(kwargs or {}))
        for value in tree_flatten(output)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value, func)
        return output


def _first_tensor(output: Any) -> torch.Tensor:
    for value in tree_flatten(output)[0]:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    raise EstimatorInputError("module output holds no tensor that requires grad; cannot run backward")


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    """Example inputs as (args, kwargs): a dict is keyword arguments, a tuple positional."""
    if isinstance(inputs, dict):
        return (), inputs
    if (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list))
            and isinstance(inputs[1], dict)):
        return tuple(inputs[0]), inputs[1]
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def traced_activation_bytes(
    module: nn.Module,
    example_inputs: ExampleInputs,
    micro_batch: int,
    seq_len: int,
    compute_dtype: torch.dtype,
    device: str | None = None,
) -> int:
    """Peak live bytes of one forward+backward on fake tensors, beyond the model states
    (:func:`traced_activations`' peak)."""
    return traced_activations(module, example_inputs, micro_batch, seq_len, compute_dtype, device=device).peak


def traced_activations(
    module: nn.Module,
    example_inputs: ExampleInputs,
    micro_batch: int,
    seq_len: int,
    compute_dtype: torch.dtype,
    find_units: Callable[[nn.Module], list[nn.Module]] | None = None,
    device: str | None = None,
) -> "TracedActivations":
    """Peak live bytes of one forward+backward on fake tensors, beyond the model states, and
    what each unit (``find_units(module)``; default none) saves for backward (traced_blocks.py).

    The meta module is copied onto *fake* tensors of ``device`` (default: ``cuda`` when
    available, else ``cpu``; nothing is allocated): ops then dispatch as they would on
    that device, so fused attention keeps no s×s score matrices where the real device
    would not (plain meta tensors take the math path and over-count them). Should the
    fake run fail, the module is traced on meta tensors instead.

    Gradients are dropped as soon as they are accumulated (as ZeRO-2/3 do after the
    reduce-scatter) so the peak counts activations and temporaries, not the ``grads``
    term that the plans already count. A module that returns logits is reduced with
    ``.sum()``; one that returns its loss is measured exactly as it runs.
    """
    if not _is_meta(module):
        raise EstimatorInputError("traced estimates need a module on the meta device; use load_module")
    with torch.device("meta"):
        inputs = _as_call(example_inputs(micro_batch, seq_len))
    inputs = tree_map(lambda t: t.to(device="meta", dtype=compute_dtype)
                      if isinstance(t, torch.Tensor) and t.is_floating_point() else
                      (t.to("meta") if isinstance(t, torch.Tensor) else t), inputs)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    find_units = find_units or (lambda _module: [])
    try:
        return _traced_on_fake(module, inputs, compute_dtype, torch.device(device),
                               UnitRecorder(find_units, micro_batch))
    except Exception:  # an op without a fake kernel for this device: meta still works
        pass
    try:
        return _traced(copy.deepcopy(module).to(compute_dtype), inputs, contextlib.nullcontext(),
                       UnitRecorder(find_units, micro_batch))
    except Exception as error:  # the model itself refuses these inputs: say so in one line
        raise EstimatorInputError(f"tracing the module at micro-batch {micro_batch}, sequence "
                                  f"{seq_len} failed: {type(error).__name__}: {error}") from error


def _traced_on_fake(module: nn.Module, inputs: tuple[tuple, dict], compute_dtype: torch.dtype, device: torch.device,
                    recorder: UnitRecorder) -> "TracedActivations":
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    to_fake = lambda t: mode.fake_tensor_converter.from_meta_and_device(mode, t, device)  # noqa: E731
    memo: dict[int, Any] = {}
    for _, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) not in memo:
            value = parameter.detach().to(compute_dtype) if parameter.is_floating_point() else parameter.detach()
            memo[id(parameter)] = nn.Parameter(to_fake(value), requires_grad=parameter.requires_grad)
    for _, buffer in module.named_buffers(remove_duplicate=False):
        memo.setdefault(id(buffer), to_fake(buffer.detach()))
    fake_module = copy.deepcopy(module, memo)
    fake_inputs = tree_map(lambda t: to_fake(t) if isinstance(t, torch.Tensor) else t, inputs)
    recorder.copies_in_flight = 1 if device.type == "cuda" else 0  # off CUDA offload copies are plain
    return _traced(fake_module, fake_inputs, mode, recorder)


def _traced(module: nn.Module, inputs: tuple[tuple, dict], mode: Any, recorder: UnitRecorder) -> "TracedActivations":
    """Peak bytes created by one forward+backward of ``module`` under ``mode``, and its units'."""
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in module.parameters() if p.requires_grad]
    hooks += recorder.attach(module)
    tracker = LiveBytesTracker(recorder.on_output, recorder.on_live)
    recorder.tracked = tracker.tracks
    args, kwargs = inputs
    try:
        with mode, tracker, torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
            output = _first_tensor(module(*args, **kwargs))
            loss = output if output.ndim == 0 else output.sum()
            del output
            loss.backward()
            del loss
    finally:
        for hook in hooks:
            hook.remove()
    return recorder.result(tracker.peak_bytes)



def _drop_grad(parameter: torch.Tensor) -> None:
    parameter.grad = None
