"""Mixed precision in the step: casting inputs, and fp16's dynamic loss scaling (the dtypes: policies.py).

With ``param_dtype`` set, parameters (and so the forward and backward) run in
that dtype while the optimizer steps fp32 master slices; gradients are reduced
in ``reduce_dtype`` (default: ``param_dtype``). fp16 needs a loss scale so
small gradients do not flush to zero; bf16 has fp32's exponent range and needs
none.

[Note: scaling without touching the user's backward]
The scale is applied by a hook on the gradient flowing into the model's
outputs: every parameter gradient is linear in it, so they all come out
scaled, and ``loss.backward()`` stays a plain call. Only *source* outputs get
the hook, those not computed from another output: a Hugging Face model
returns ``(loss, logits)`` with the loss computed from the logits, and
scaling both would scale the logits' gradient twice. Every path from the
user's loss into the model passes through a source output, except a loss
term on the parameters themselves (a hand-written L2 penalty): use the
optimizer's weight decay for that under fp16. The window's gradients are
divided by the scale once (see stages/window.py), so ``clip_grad_norm_`` sees true
values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..errors import LossScaleCollapsed


@dataclass
class DynamicLossScaler:
    """Multiply the loss by ``scale``; halve it on overflow (skipping the step), grow it
    after ``growth_interval`` clean steps.

    >>> scaler = DynamicLossScaler(scale=8.0, growth_interval=2)
    >>> scaler.update(found_inf=True); scaler.scale, scaler.skipped_steps
    (4.0, 1)
    >>> scaler.update(False); scaler.update(False); scaler.scale
    8.0
    """

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_skips_at_min: int = 50
    skipped_steps: int = 0
    clean_steps: int = 0
    skips_at_min: int = 0

    def update(self, found_inf: bool) -> None:
        if not found_inf:
            self.clean_steps += 1
            self.skips_at_min = 0
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
            return
        self.skipped_steps += 1
        self.clean_steps = 0
        if self.scale <= self.min_scale:
            self._report_collapse()
        self.scale = max(self.scale * self.backoff_factor, self.min_scale)

    def _report_collapse(self) -> None:
        self.skips_at_min += 1
        message = (f"fp16 loss scale is at its minimum ({self.min_scale}) and gradients still "
                   f"overflow: {self.skips_at_min} step(s) skipped in a row, {self.skipped_steps} "
                   "in all. The loss or learning rate has likely diverged; consider bf16.")
        if self.skips_at_min >= self.max_skips_at_min:
            raise LossScaleCollapsed(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


# Nodes searched per output for another output among its ancestors: a loss computed from
# the logits is a few nodes away; anything deeper is treated as independent.
_ANCESTOR_SEARCH_NODES = 128


def outputs_to_scale(tensors: list[torch.Tensor]) -> set[int]:
    """Ids of the *source* outputs: those with no other output among their ancestors.

    >>> w = torch.ones(3, requires_grad=True)
    >>> logits = w * 2; loss = logits.sum(); other = w * 3
    >>> sorted(name for name, t in [("logits", logits), ("loss", loss), ("other", other)]
    ...        if id(t) in outputs_to_scale([logits, loss, other]))
    ['logits', 'other']
    """
    if len(tensors) <= 1:
        return {id(t) for t in tensors}
    owner = {t.grad_fn: t for t in tensors if t.grad_fn is not None}
    derived: set[int] = set()
    for tensor in tensors:
        seen, frontier = set(), [n for n, _ in tensor.grad_fn.next_functions] if tensor.grad_fn else []
        while frontier and len(seen) < _ANCESTOR_SEARCH_NODES:
            node = frontier.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in owner:
                derived.add(id(tensor))
                break
            frontier.extend(n for n, _ in node.next_functions)
    return {id(t) for t in tensors if id(t) not in derived}


def cast_floats(value, dtype: torch.dtype):
    """``value`` with floating-point tensors (nested in tuples/lists/dicts) cast to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value
