"""Numerics at sync: the trainer's and the rollout model's log-probs on a probe batch, compared.

[Note: is it the dtype?]
A bf16 rollout of an fp32 trainer disagrees with it by a few hundredths of a nat per token
(about 0.03 nats RMS is typical); a rollout holding stale or wrongly loaded weights
disagrees by far more, and people usually find out from diverging rewards. So the report
puts the rollout's disagreement beside what the rollout's dtype alone explains: the
trainer's own forward with every matmul in that dtype (``torch.autocast``: each weight
cast to the dtype, as the rollout holds it, and the matmul inputs too), on the same probe.
The disagreement is *explained by the dtype* when the rollout's mean |Δ| is at most
``tolerance`` times the reference's (a rollout that also keeps its norms and residual
stream in the low dtype sits above the autocast reference: measured 1.3-1.9x on two tiny
Llamas in bf16 and fp16, so ``tolerance`` is 3 by default; one MLP weight of the rollout
scaled by 1.5 measured 3.6x and 25x). An fp32 rollout has no dtype to blame: its
disagreement is explained only when it is at rounding level (1e-5 nats).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)
ROUNDING_NATS = 1e-5  # what an fp32 rollout may differ by and still be "the same weights"

LogProbs = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
    """log p(token t | tokens < t) for t = 1..T-1 of each row, in fp32: shape ``(B, T-1)``.

    ``model`` returns logits (a tensor, a tuple led by them, or an output with ``.logits``,
    as Hugging Face causal LMs do); called under ``no_grad``.

    >>> import torch
    >>> class Uniform(torch.nn.Module):
    ...     def forward(self, ids): return torch.zeros(*ids.shape, 4)
    >>> token_logprobs(Uniform(), torch.tensor([[0, 1, 2]])).exp()
    tensor([[0.2500, 0.2500]])
    """
    with torch.no_grad():
        if attention_mask is None:
            output = model(input_ids)
        else:
            output = model(input_ids=input_ids, attention_mask=attention_mask)
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None].to(logp.device)).squeeze(-1)


@dataclass(frozen=True)
class SyncNumerics:
    """The rollout's log-probs against the trainer's on a probe batch, in nats (see the Note)."""

    tokens: int
    max_abs: float
    mean_abs: float
    rms: float
    rollout_dtype: Optional[torch.dtype]
    dtype_max_abs: float       # the trainer in the rollout's dtype (autocast) against the trainer
    dtype_mean_abs: float
    explained_by_dtype: bool
    tolerance: float

    def __str__(self) -> str:
        dtype = str(self.rollout_dtype).removeprefix("torch.") if self.rollout_dtype else "?"
        verdict = "explained by the dtype" if self.explained_by_dtype else "NOT explained by the dtype"
        return (f"rollout vs trainer log-probs over {self.tokens} tokens: max |Δ| {self.max_abs:.4g}, "
                f"mean |Δ| {self.mean_abs:.4g}, RMS {self.rms:.4g} nats; the trainer in {dtype}: max "
                f"{self.dtype_max_abs:.4g}, mean {self.dtype_mean_abs:.4g}; {verdict}")


def compare_logprobs(trainer: torch.Tensor, rollout: torch.Tensor, reference: Optional[torch.Tensor] = None,
                     mask: Optional[torch.Tensor] = None, rollout_dtype: Optional[torch.dtype] = None,
                     tolerance: float = 3.0) -> SyncNumerics:
    """The report over the tokens ``mask`` keeps; ``reference``: the trainer's log-probs in the
    rollout's dtype (None: that dtype is the trainer's, nothing to blame).

    >>> t = torch.tensor([[-1.0, -2.0]])
    >>> compare_logprobs(t, t + 0.01, reference=t + 0.008, rollout_dtype=torch.bfloat16).explained_by_dtype
    True
    """
    keep = torch.ones_like(trainer, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    delta = (rollout.float().to(trainer.device) - trainer.float())[keep].abs()
    base = (reference.float().to(trainer.device) - trainer.float())[keep].abs() if reference is not None else \
        torch.zeros_like(delta)
    tokens = int(delta.numel())
    if tokens == 0:
        raise ValueError("the probe batch has no token to compare (every position masked)")
    mean, base_mean = delta.mean().item(), base.mean().item()
    explained = mean <= tolerance * base_mean + ROUNDING_NATS
    return SyncNumerics(tokens, delta.max().item(), mean, math.sqrt(delta.pow(2).mean().item()), rollout_dtype,
                        base.max().item(), base_mean, bool(explained), tolerance)


def dtype_reference(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """The trainer's log-probs with its matmuls in ``dtype`` (None when ``dtype`` is not a 16-bit one)."""
    if dtype not in LOW_PRECISION:
        return None
    with torch.autocast(input_ids.device.type, dtype=dtype):
        return token_logprobs(model, input_ids, attention_mask)


def check_numerics(model: nn.Module, rollout: Union[LogProbs, torch.Tensor, None], input_ids: torch.Tensor,
                   attention_mask: Optional[torch.Tensor] = None, rollout_dtype: Optional[torch.dtype] = None,
                   tolerance: float = 3.0) -> Optional[SyncNumerics]:
    """Compare the trainer ``model`` (sharded or not: every rank of a sharded one calls this) with the
    rollout on a probe batch. ``rollout``: its log-probs (``(B, T-1)``) or a function giving them;
    None on a rank without a rollout model, which only takes part in the trainer's forwards and
    returns None."""
    mask = attention_mask[:, 1:] if attention_mask is not None else None
    trainer = token_logprobs(model, input_ids, attention_mask)
    reference = dtype_reference(model, input_ids, attention_mask, rollout_dtype)
    got = rollout(input_ids, attention_mask) if callable(rollout) else rollout
    if got is None:
        return None
    return compare_logprobs(trainer, got, reference, mask, rollout_dtype, tolerance)
