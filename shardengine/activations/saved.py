"""Saved-tensor hooks: what autograd keeps for backward passes through here to be counted.

[Note: saved-tensor hooks, pushed and popped by module hooks]
A forward's saved tensors are seen through ``torch.autograd.graph``'s default
saved-tensor hooks, pushed when the root's (or a block's) forward starts and popped
when it returns, from module hooks: they run eagerly under ``torch.compile`` too
(compile_support.py), where a compiled graph's saved tensors pass through them as
well. Only the innermost pair of hooks applies, so a scope is pushed only onto an
empty stack (the root) or onto this engine's own root scope (a block): a user's own
``saved_tensors_hooks`` or a checkpoint region of the model's own always wins, and
that forward's activations then go uncounted (``unmeasured_forwards``). A forward
that raises leaves its scopes pushed; the next root forward pops them
(:meth:`HookStack.unwind`).

Hooks skip autograd's check that a saved tensor was not changed in place before
backward used it; :class:`Kept` restores it (same message as torch's), so a user's
in-place mistake is still an error, never a silent wrong gradient.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..activation_rules import is_parameter
from .ledger import ActivationLedger, Token

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


class Kept:
    """A saved tensor kept where it is: the tensor (detached: no cycle through its grad_fn),
    the version it was saved at, and its hold on the ledger (None for a parameter)."""

    __slots__ = ("tensor", "version", "token")

    def __init__(self, tensor: torch.Tensor, token: Optional[Token]):
        self.tensor = tensor if tensor.grad_fn is None else tensor.detach()
        self.version = tensor._version
        self.token = token

    def unpack(self) -> torch.Tensor:
        check_version(self.tensor, self.version)
        return self.tensor


def check_version(tensor: Optional[torch.Tensor], saved_version: int) -> None:
    if tensor is not None and tensor._version != saved_version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected "
            f"version {saved_version} instead. Hint: the operation that changed it ran after the forward "
            "that saved it; clone the tensor before changing it.")


def keep(ledger: ActivationLedger, tensor: torch.Tensor, host_device: bool = False) -> Kept:
    """``tensor`` kept where it is, counted (unless a parameter) on the device or, when it
    already lives in host memory of a device run (``host_device``), on the host."""
    if is_parameter(tensor):
        return Kept(tensor, None)
    on_host = host_device and tensor.device.type == "cpu"
    return Kept(tensor, ledger.keep(tensor, on_host))


def counting_hooks(ledger: ActivationLedger, device: torch.device) -> Hooks:
    """The root scope's hooks: count what is saved, move nothing."""
    host_device = device.type not in ("cpu", "meta")
    return (lambda tensor: keep(ledger, tensor, host_device)), Kept.unpack


class HookStack:
    """Push and pop default saved-tensor hooks, and look at the one on top (see the Note)."""

    def __init__(self) -> None:
        self._pushed: list[Callable] = []  # the pack hooks this object pushed, innermost last

    @staticmethod
    def top() -> Optional[Hooks]:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        return top(False) if top is not None else None

    @staticmethod
    def usable() -> bool:
        """False where hooks are disabled (inside torch.func transforms)."""
        enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
        return enabled() if enabled is not None else True

    def on_top(self) -> bool:
        """The innermost hooks are ours."""
        top = self.top()
        return bool(self._pushed) and top is not None and top[0] is self._pushed[-1]

    def push(self, hooks: Hooks) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
        self._pushed.append(hooks[0])

    def pop(self) -> None:
        """Pop our innermost scope (only when it is on top: never someone else's)."""
        if self.on_top():
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._pushed.pop()

    def unwind(self) -> None:
        """Pop what a forward that raised left pushed."""
        while self.on_top():
            self.pop()
        self._pushed.clear()


def inside_foreign_checkpoint() -> bool:
    """The innermost saved-tensor hooks are a ``torch.utils.checkpoint`` region's: the model
    (or its caller) checkpoints this code itself."""
    top = HookStack.top()
    return top is not None and getattr(top[0], "__module__", "") == "torch.utils.checkpoint"
