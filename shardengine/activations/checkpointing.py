"""Activation checkpointing of one block: torch's non-reentrant checkpoint, full or selective.

[Note: checkpointing a block's forward, inside its hooks]
A checkpointed block's ``forward`` is replaced (on the instance) by
:class:`CheckpointedForward`, which runs the original forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. The block's module hooks
(stage 3's gather and free, the saved-tensor scopes of blocks.py) stay *outside* the
checkpointed region, as FSDP2's hooks sit outside torchtitan's ``checkpoint_wrapper``:
the recomputation in backward reruns the forward alone, never a hook. At stage 3 it
finds its unit gathered because the unit's backward pre-hook gathers it when the
gradient of the unit's output arrives, before autograd runs any node of the unit's
graph, and the first such node is what asks for the recomputation; frozen weights
(a LoRA base) are gathered with the rest of the unit, and the unit is released
only when its backward is over (stages/unit_backward.py), so recomputation never
reads a freed weight. Nothing is reduced twice: the recomputed graph is never
differentiated, only its saved tensors are read by the original graph.

``selective:mm`` passes torch's selective-checkpoint contexts
(``create_selective_checkpoint_contexts``) a policy that saves the output of each
matmul (``mm``, ``addmm``, ``bmm``, ``baddbmm``) and attention kernel and recomputes
the rest; ``selective:mm/2`` saves every second matmul (and every attention) output,
counted per forward of the block, as torchtitan's op AC does. What the contexts
cache, and what a recomputation saves again, is counted on the ledger
(``keep_while_alive``: torch owns those tensors) unless the forward is being traced
by ``torch.compile``, whose graphs' saved tensors reach the saved-tensor hooks.

The replacement is never reached from a recomputation of someone else's (a forward
run inside backward, or with grad disabled, runs plainly) and refuses to run inside
another ``torch.utils.checkpoint`` region: a block is never checkpointed twice.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError
from ..flat.units import in_backward
from .ledger import ActivationLedger
from ..activation_rules import CheckpointRule
from ..activation_rules import is_parameter
from .saved import HookStack, inside_foreign_checkpoint

_aten = torch.ops.aten
MATMUL_OPS = frozenset(op for op in (_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                                     _aten.baddbmm.default))
ATTENTION_OPS = frozenset(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward") if hasattr(_aten, name))


def selective_mm_contexts(rule: CheckpointRule, ledger: Optional[ActivationLedger]) -> tuple:
    """torch's selective-checkpoint contexts saving matmul and attention outputs (see the Note);
    one call per checkpointed forward, so the matmul count starts at 0 each time."""
    matmuls = [0]

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in ATTENTION_OPS:
            save = True
        elif op in MATMUL_OPS:
            matmuls[0] += 1
            save = rule.saves_matmul(matmuls[0])
        else:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if save and ledger is not None and not torch.compiler.is_compiling():
            output = getattr(ctx, "op_output", None)
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor):
                    ledger.keep_while_alive(tensor)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _CountingRecompute:
    """Saved-tensor hooks over a recomputation's own: count what it saves, then hand it on."""

    def __init__(self, ledger: ActivationLedger):
        self.ledger = ledger
        self.stack = HookStack()

    def __enter__(self) -> None:
        inner = HookStack.top()
        if inner is None:  # not inside torch's recomputation: nothing to count through
            return

        def pack(tensor: torch.Tensor) -> Any:
            if not is_parameter(tensor):
                self.ledger.keep_while_alive(tensor)
            return inner[0](tensor)

        self.stack.push((pack, inner[1]))

    def __exit__(self, *exc) -> None:
        self.stack.pop()


class CheckpointedForward:
    """A block's forward run under torch's non-reentrant checkpoint (see the Note)."""

    def __init__(self, original: Callable, rule: CheckpointRule, ledger: Optional[ActivationLedger],
                 block_name: str, policy_text: str, context_fn: Optional[Callable[[], tuple]] = None):
        self.original, self.rule, self.ledger = original, rule, ledger
        self.block_name, self.policy_text = block_name, policy_text
        if context_fn is None and rule.kind == "mm":
            context_fn = functools.partial(selective_mm_contexts, rule, ledger)
        self.context_fn = context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            if not torch.is_grad_enabled() or in_backward():
                return self.original(*args, **kwargs)  # nothing to save, or someone's recomputation
            if inside_foreign_checkpoint():
                raise ConfigError(
                    f"{self.block_name} runs inside a torch.utils.checkpoint region the model (or its "
                    f"caller) opened, and activation_checkpointing={self.policy_text!r} checkpoints it "
                    "too: it would be recomputed twice. Drop the model's own checkpointing (Hugging Face: "
                    "model.gradient_checkpointing_disable()) or activation_checkpointing.")
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self._run, *args, use_reentrant=False, **extra, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.ledger is not None and not torch.compiler.is_compiling() and in_backward():
            with _CountingRecompute(self.ledger):
                return self.original(*args, **kwargs)
        return self.original(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable:
        # copy.deepcopy of the model (an EMA): the copy is a plain module, its forward the
        # original one bound to the copied block (a bound method deep-copies onto memo's copy)
        return copy.deepcopy(self.original, memo)
