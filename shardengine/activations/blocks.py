"""An activation policy applied to a model's blocks: checkpointing, offload, and the counting.

:class:`BlockActivations` is what the engine (stages/engine.py) and the estimator's
traced path (memory_estimator/model/module.py) both build for a module, so that the
estimate models exactly what the engine keeps. It

* replaces each checkpointed block's forward (checkpointing.py);
* pushes the root's counting scope when a training forward starts and pops it when
  it returns, and with offload a scope per block inside it (saved.py, offload.py);
* keeps the :class:`~shardengine.activations.ledger.ActivationLedger` that
  ``memory_report()`` reads.

[Note: no hooks unless asked for]
With no policy and ``measure=False`` (the default), :meth:`BlockActivations.register`
registers nothing: a training forward then pushes no saved-tensor hooks, and autograd
saves its tensors with no Python call per tensor, as under DDP or FSDP2 (counting them
cost up to 1.02-1.04x a 10m GPT's CPU step at stage 0: ``benchmarks/bench_activations.py
--measure-activations``, docs/activations.md). ``memory_report()`` then says the activations were not
measured (None), never 0 bytes.

The blocks are the stage-3 units (flat/units.py: every ``nn.ModuleList`` element, or
the ``wrap`` classes), in the model's order; the root's own layers are never
checkpointed or offloaded, only counted.

>>> import torch, shardengine as se
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2)))
>>> len(model_blocks(net, None, None))
2
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import ConfigError
from ..flat.units import _unit_roots, in_backward
from .checkpointing import CheckpointedForward
from .ledger import ActivationLedger
from .offload import ForwardPass, HostMover
from ..activation_rules import offloaded_blocks
from .saved import HookStack, counting_hooks, inside_foreign_checkpoint

if TYPE_CHECKING:  # the policy is read, never built, here (policies.py imports activation_rules.py)
    from ..policies import Activations

HookWrapper = Callable[[Callable], Callable]
# MemoryReport's activation fields, in the order bytes() fills them
ACTIVATION_FIELDS = ("activations", "peak_activations", "host_activations", "peak_host_activations")


def model_blocks(module: nn.Module, wrap: Optional[tuple[type, ...]],
                 wrap_min_params: Optional[int]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each block: the stage-3 units but the root, in the model's order."""
    return _unit_roots(module, wrap, wrap_min_params)


def check_not_self_checkpointing(module: nn.Module, policy: "Activations") -> None:
    """A model that checkpoints its own layers gets a clear error, never a second checkpoint."""
    for name, sub in module.named_modules():
        if getattr(sub, "gradient_checkpointing", False) is True:
            raise ConfigError(
                f"the model checkpoints its own layers ({name or type(sub).__name__}.gradient_checkpointing is "
                f"on: Hugging Face's gradient_checkpointing_enable()), and activation_checkpointing="
                f"{policy.checkpoint!r}, activation_offload={policy.offload!r} manages the same blocks: a "
                "block would be checkpointed twice, or offloaded inside someone else's checkpoint. Call "
                "model.gradient_checkpointing_disable() and pass activation_checkpointing='full' (the same "
                "non-reentrant checkpoint of each layer), or drop the activations policy.")
        if type(sub).__name__ in ("CheckpointWrapper", "OffloadWrapper"):
            raise ConfigError(
                f"{name} is wrapped by torch's {type(sub).__name__} (checkpoint_wrapper / offload_wrapper), "
                f"and activation_checkpointing={policy.checkpoint!r}, activation_offload={policy.offload!r} "
                "manages the same blocks: they would be checkpointed or offloaded twice. Unwrap them and let "
                "the policy do it, or drop the policy.")


class _ForwardOverride:
    """A handle restoring a block's own forward (as a hook handle removes its hook)."""

    def __init__(self, module: nn.Module, had_own: bool, own: Any):
        self.id = RemovableHandle(OrderedDict()).id  # an id no hook handle has (deepcopy drops ours by id)
        self.module, self.had_own, self.own = module, had_own, own

    def remove(self) -> None:
        if self.had_own:
            self.module.forward = self.own
        else:
            self.module.__dict__.pop("forward", None)


class BlockActivations:
    """A policy applied to one model (see the module docstring)."""

    def __init__(self, module: nn.Module, blocks: list[tuple[str, nn.Module]], policy: "Activations",
                 device: torch.device, hook_wrapper: HookWrapper = lambda fn: fn):
        if policy.enabled:
            if not blocks:
                raise ConfigError(
                    f"activation_checkpointing={policy.checkpoint!r}, activation_offload={policy.offload!r} "
                    "found no blocks: the model has no nn.ModuleList of blocks (and no wrap= classes). Name "
                    "its repeated layers with wrap=(MyBlock,).")
            check_not_self_checkpointing(module, policy)
        self.module, self.blocks, self.policy = module, blocks, policy
        self.device = _indexed(device)
        self.ledger = ActivationLedger()
        self.unmeasured_forwards = 0  # training forwards whose saved tensors someone else's hooks took
        self.stack = HookStack()
        self.mover = HostMover(self.device) if policy.offload is not False else None
        self.offloads = offloaded_blocks(policy.offload, len(blocks))
        self._wrap = hook_wrapper
        self._pass: Optional[ForwardPass] = None
        self._depth: list[bool] = []  # per root forward in progress: did it push its scope?
        self._block_pushed: list[bool] = []

    def register(self) -> list:
        """Replace the checkpointed blocks' forwards and register the scopes' hooks; the handles
        (none without a policy or ``measure``: see [Note: no hooks unless asked for])."""
        if not self.policy.measured:
            return []
        handles: list = [self._override(index, name, block) for index, (name, block) in enumerate(self.blocks)
                         if self.policy.rule.checkpoints(index)]
        wrap = self._wrap
        if self.policy.rule.kind != "none" and _caches_keys_and_values(self.module):
            handles.append(self.module.register_forward_pre_hook(wrap(_no_cache_while_training), with_kwargs=True))
        handles.append(self.module.register_forward_pre_hook(wrap(self._root_enter)))
        # always_call: a forward that raises must pop its scopes too, or they would stay pushed
        # and take the saved tensors of every later forward, of any model in the process
        handles.append(self.module.register_forward_hook(wrap(self._root_exit), always_call=True))
        if self.mover is not None:
            for index, (_, block) in enumerate(self.blocks):
                handles.append(block.register_forward_pre_hook(
                    wrap(lambda mod, args, index=index, block=block: self._block_enter(mod, block, index))))
                handles.append(block.register_forward_hook(
                    wrap(lambda mod, args, out, block=block: self._block_exit(mod, block)), always_call=True))
        return handles

    def _override(self, index: int, name: str, block: nn.Module) -> _ForwardOverride:
        had_own = "forward" in block.__dict__
        handle = _ForwardOverride(block, had_own, block.__dict__.get("forward"))
        block.forward = CheckpointedForward(block.forward, self.policy.rule, self.ledger,
                                            f"block {name!r}", self.policy.checkpoint)
        return handle

    # ------------------------------------------------------------------ scopes

    def _training_forward(self) -> bool:
        return torch.is_grad_enabled() and not in_backward() and HookStack.usable()

    def _root_enter(self, module: nn.Module, args: Any) -> None:
        if module is not self.module:
            return None
        if not self._depth:
            self.stack.unwind()  # a forward that raised left its scopes pushed
            self._block_pushed.clear()
        pushed = False
        if self._training_forward() and not self._depth:
            if HookStack.top() is None:
                self.stack.push(counting_hooks(self.ledger, self.device))
                pushed = True
                if self.mover is not None:
                    self._pass = ForwardPass(self.mover, self.ledger, self.device.type != "cpu")
            else:
                self.unmeasured_forwards += 1
        self._depth.append(pushed)
        return None

    def _root_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if module is not self.module or not self._depth:
            return None
        if self._depth.pop():
            self.stack.pop()
            self._pass = None
            if self.mover is not None:
                self.mover.in_flight.release_finished()
        return None

    def _block_enter(self, module: nn.Module, block: nn.Module, index: int) -> None:
        if module is not block:
            return
        pushed = False
        if self._pass is not None and self.stack.on_top():
            stash = self._pass.open_block(self.offloads[index])
            self.stack.push(stash.hooks())
            pushed = True
        elif self.offloads[index] and self._pass is not None and inside_foreign_checkpoint():
            raise ConfigError(
                f"block {self.blocks[index][0]!r} runs inside a torch.utils.checkpoint region the model opened, "
                f"and activation_offload={self.policy.offload!r} would offload inside it; use "
                "activation_checkpointing= instead of the model's own checkpointing")
        self._block_pushed.append(pushed)

    def _block_exit(self, module: nn.Module, block: nn.Module) -> None:
        if module is block and self._block_pushed and self._block_pushed.pop():
            self.stack.pop()
            self.mover.in_flight.release_finished()

    # ------------------------------------------------------------------ reports

    def bytes(self, reset_peaks: bool = False) -> dict[str, Optional[int]]:
        """Activation bytes kept now and at most (since the last reset), on the device and host;
        None each when they are not measured."""
        ledger = self.ledger
        if not self.policy.measured:
            return dict.fromkeys(ACTIVATION_FIELDS)
        report = dict(zip(ACTIVATION_FIELDS, (ledger.device.current, ledger.device.peak,
                                              ledger.host.current, ledger.host.peak)))
        if reset_peaks:
            ledger.reset_peaks()
        return report


def _caches_keys_and_values(module: nn.Module) -> bool:
    """A Hugging Face model (or a PEFT model around one): its config has ``use_cache``."""
    return getattr(getattr(module, "config", None), "use_cache", None) is not None


def _no_cache_while_training(module: nn.Module, args: Any, kwargs: dict) -> Optional[tuple]:
    """A checkpointed layer's recomputation must see the state its forward saw; a key/value cache
    the forward appended to has changed (the recomputed attention would read twice the keys, or
    torch's selective checkpoint would find other ops). Hugging Face's own checkpointing turns
    ``use_cache`` off in training for the same reason; so does the engine's."""
    if not (module.training and torch.is_grad_enabled()) or kwargs.get("use_cache") is False:
        return None
    if kwargs.get("use_cache") is True:
        warnings.warn("use_cache=True does not combine with activation checkpointing (a recomputed layer would "
                      "read the keys and values its forward added to the cache): training forwards run with "
                      "use_cache=False, as Hugging Face's gradient checkpointing does", stacklevel=3)
    return args, {**kwargs, "use_cache": False}


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device

