"""Optimizers: their state per element, the temporaries of their step, and naming a live one.

State per element, in the state dtype (fp32, or bf16/fp16 under a pure low-precision
policy), excluding any fp32 master copy:

- adam / adamw: ``exp_avg`` and ``exp_avg_sq`` (2 slots); the scalar ``step`` is ignored.
- sgd-momentum: one momentum buffer; plain sgd keeps nothing.
- adam8bit: two 1-byte quantized moments whatever the weights' dtype; the per-block
  scales (one fp32 per block of 256-2048 elements in bitsandbytes) are < 0.03 B/param
  and ignored.
- adafactor: the factored second moment is rows + cols per matrix, so ~0 per element;
  callers that know the shapes add it (``ModelStats.factored_state_numel``).
- muon: one momentum buffer (``momentum_buffer``, torch.optim.Muon); its step
  orthogonalizes each whole matrix with Newton-Schulz iterations (temporaries below).
- muon-adamw: the Muon recipe, Muon on the blocks' matrices and AdamW on the rest
  (embeddings, head): one slot everywhere plus AdamW's second slot on the parameters
  outside the blocks (``EngineContext.factored_bytes``; the blocks' norms and biases are
  counted at one slot).
- paged-adamw8bit / paged-adamw: bitsandbytes' paged AdamW (8-bit or 32-bit states) in
  CUDA unified memory, outside torch's allocator (``finetune_terms.py``). The 32-bit one
  allocates fp32 states whatever the weights' dtype (``Optimizer2State.init_state``:
  ``optim_bits == 32`` -> ``torch.float32``), 8 bytes per element even under pure bf16.

Step temporaries by implementation (torch/optim/adam.py, torch/optim/optimizer.py):

- ``foreach`` (torch's default on CUDA): Adam builds ``torch._foreach_sqrt`` of every
  ``exp_avg_sq`` it steps before dividing in place — one state-dtype copy of all the
  stepped elements ("the foreach implementation uses ~ sizeof(params) more peak memory
  than the for-loop version", torch.optim docs). SGD works in place.
- ``plain`` (the for-loop, ``foreach=False``): Adam's ``exp_avg_sq.sqrt()`` and its
  quotient, two temporaries the size of the largest stepped tensor.
- ``fused`` (``fused=True``, bitsandbytes, DeepSpeed's FusedAdam): one kernel, none.

Adam with L2 weight decay (not AdamW) under ``foreach`` adds one more gradient-sized
list when the decay is non-zero; the estimator assumes decoupled or zero decay.

>>> import torch
>>> net = torch.nn.Linear(2, 2)
>>> optimizer_name(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
'sgd-momentum'
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import EstimatorInputError

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adam8bit", "paged-adamw8bit", "paged-adamw",
              "muon", "muon-adamw")
IMPLEMENTATIONS = ("foreach", "fused", "plain")
# torch's own classes, which shardengine steps one flat bucket at a time ([Note: a bounded
# step] in shardengine/optim/bucketed_step.py); bitsandbytes' are stepped over everything at once.
STEPPED_BY_BUCKET = frozenset({"adamw", "adam", "sgd", "sgd-momentum", "adafactor", "muon", "muon-adamw"})
# Elementwise updates: a for-loop (``plain``) step's temporaries are over one stepped tensor at a
# time, whichever tensors the optimizer is handed (shardengine hands it a parameter's fragment).
ELEMENTWISE = frozenset({"adamw", "adam", "sgd", "sgd-momentum"})
SUPPORTED = ("torch.optim.Adam, AdamW, SGD (with or without momentum), Adafactor and Muon; bitsandbytes' "
             "AdamW8bit, PagedAdamW8bit and PagedAdamW")

# (state slots in the state dtype, bytes per element regardless of dtype)
_STATE = {"adamw": (2, 0), "adam": (2, 0), "sgd": (0, 0), "sgd-momentum": (1, 0),
          "adafactor": (0, 0), "adam8bit": (0, 2), "paged-adamw8bit": (0, 2), "paged-adamw": (0, 8),
          "muon": (1, 0), "muon-adamw": (1, 0)}
# Temporaries in units of the stepped elements (foreach) / of the largest tensor (plain).
_FOREACH_TEMPORARIES = {"adamw": 1, "adam": 1, "sgd": 0, "sgd-momentum": 0, "adafactor": 1, "adam8bit": 0,
                        "paged-adamw8bit": 0, "paged-adamw": 0, "muon": 0, "muon-adamw": 0}
_PLAIN_TEMPORARIES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 0, "adafactor": 2, "adam8bit": 0,
                      "paged-adamw8bit": 0, "paged-adamw": 0, "muon": 0, "muon-adamw": 0}
# Muon orthogonalizes each whole matrix (m x n, k = min) in bf16 (torch/optim/_muon.py):
# X and the next X (2·2mn), X·Xᵀ and its polynomial (2·2k²), and the Nesterov update in
# the gradient's dtype (4mn): 8mn + 4k² <= 12mn bytes for the largest matrix.
MUON_TEMPORARY_BYTES_PER_ELEMENT = 12


def check_optimizer(optimizer: str) -> str:
    if optimizer not in _STATE:
        raise EstimatorInputError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    return optimizer


def check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise EstimatorInputError(f"unknown optimizer implementation {implementation!r}; "
                                  f"choose from {', '.join(IMPLEMENTATIONS)}")
    return implementation


def state_bytes_per_element(optimizer: str, state_dtype_bytes: int) -> int:
    """Optimizer-state bytes per stepped element (no master copy).

    >>> state_bytes_per_element("adamw", 4), state_bytes_per_element("adamw", 2)
    (8, 4)
    >>> state_bytes_per_element("adam8bit", 4)
    2
    """
    slots, fixed = _STATE[check_optimizer(optimizer)]
    return slots * state_dtype_bytes + fixed


def step_temporary_bytes(optimizer: str, implementation: str, stepped_numel: int, largest_numel: int,
                         state_dtype_bytes: int) -> int:
    """Peak bytes of the temporaries one ``optimizer.step()`` creates.

    ``stepped_numel`` elements are stepped in all (foreach batches them at once); the
    largest single stepped tensor has ``largest_numel`` (the for-loop's unit).

    >>> step_temporary_bytes("adamw", "foreach", 40, 30, 4)
    160
    >>> step_temporary_bytes("adamw", "plain", 40, 30, 4), step_temporary_bytes("adamw", "fused", 40, 30, 4)
    (240, 0)
    """
    check_optimizer(optimizer)
    if stepped_numel <= 0:
        return 0
    if optimizer in ("muon", "muon-adamw"):  # one matrix at a time, whatever the implementation
        return MUON_TEMPORARY_BYTES_PER_ELEMENT * min(largest_numel, stepped_numel)
    if check_implementation(implementation) == "fused":
        return 0
    if implementation == "foreach":
        return _FOREACH_TEMPORARIES[optimizer] * state_dtype_bytes * stepped_numel
    return _PLAIN_TEMPORARIES[optimizer] * state_dtype_bytes * min(largest_numel, stepped_numel)


def optimizer_name(optimizer: Any) -> str:
    """``"adamw"`` / ``"adam"`` / ``"sgd"`` / ``"sgd-momentum"`` for a torch optimizer instance.

    Raises :class:`EstimatorInputError` for optimizers whose state the estimator does
    not model (including Adam with ``amsgrad=True``, which keeps a third buffer).
    """
    import torch

    if isinstance(optimizer, str):
        return optimizer
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or groups is None:
        raise EstimatorInputError(f"optimizer must be a name or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        if any(group.get("amsgrad") for group in groups):
            raise EstimatorInputError(f"{kind.__name__}(amsgrad=True) keeps a third state buffer the estimator "
                                      f"does not model; supported: {SUPPORTED}")
        decoupled = kind is torch.optim.AdamW or any(group.get("decoupled_weight_decay") for group in groups)
        return "adamw" if decoupled else "adam"
    if kind is torch.optim.SGD:
        return "sgd-momentum" if any(group.get("momentum", 0) for group in groups) else "sgd"
    by_class = {"Muon": "muon", "Adafactor": "adafactor", "AdamW8bit": "adam8bit", "Adam8bit": "adam8bit",
                "PagedAdamW8bit": "paged-adamw8bit", "PagedAdamW": "paged-adamw", "PagedAdamW32bit": "paged-adamw"}
    if kind.__name__ in by_class and kind.__module__.split(".")[0] in ("torch", "bitsandbytes"):
        return by_class[kind.__name__]
    raise EstimatorInputError(f"the estimator does not model {kind.__name__}'s state; supported: {SUPPORTED}")


def optimizer_implementation(optimizer: Any, default: str) -> str:
    """``fused`` / ``foreach`` / ``plain`` as a live optimizer's first group asks, else ``default``."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return default
    group = groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is False:
        return "plain"
    return "foreach" if group.get("foreach") else default


def group_index_by_name(optimizer: Any, module: nn.Module) -> dict[str, int] | None:
    """``parameter name -> param group index`` (names as ``module.named_parameters()`` gives them)."""
    if isinstance(optimizer, str):
        return None
    index_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return {name: index_of.get(id(p)) for name, p in module.named_parameters()}


NEWTON_SCHULZ_STEPS = 5  # torch.optim.Muon's default ns_steps


def newton_schulz_flops(shapes, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """FLOPs of orthogonalizing each ``(m, n, count)`` matrix once (torch/optim/_muon.py).

    Per iteration on X (k x l, k = min(m, n)): the Gram matrix X·Xᵀ (2k²l), its square
    (2k³) and the update times X (2k²l); ARCHITECTURE.md's ≈ 2·m·n·min(m, n)·3 for a
    square matrix.

    >>> newton_schulz_flops([(4096, 4096, 1)]) == 5 * 3 * 2 * 4096**3
    True
    """
    total = 0.0
    for m, n, count in shapes:
        k, l = min(m, n), max(m, n)
        total += count * steps * (4.0 * k * k * l + 2.0 * k ** 3)
    return total
