"""PyTorch DistributedDataParallel, alone (``ddp``) or with ZeroRedundancyOptimizer (``zero1``).

- Gradient buckets: DDP's reducer allocates, at wrap time, flat buckets covering every
  gradient (``torch/csrc/distributed/c10d/reducer.cpp``, ``initialize_buckets``) and
  copies each ``param.grad`` into them to all-reduce: a second full gradient copy that
  lives all the time. ``gradient_as_bucket_view=True`` makes the gradients views of the
  buckets instead; the DDP docstring says this saves "the total gradients size"
  (``torch/nn/parallel/distributed.py``). One process trains without DDP (single-GPU
  scripts, HF Trainer on one GPU), so a world of one has no buckets.
- Gradients themselves are ``param.grad`` tensors autograd allocates in backward and
  ``zero_grad()`` frees (``set_to_none=True``, torch's default since 2.0): they count at
  the step, not beside the activations — unless they are bucket views, which persist.
- ZeroRedundancyOptimizer (``torch/distributed/optim/zero_redundancy_optimizer.py``)
  assigns *whole parameters* to ranks, greedily by size: a rank's optimizer state is at
  least its largest parameter's, so it is ``max(Ψ/N, largest tensor)`` elements. Its
  ``step`` broadcasts updated parameters in place.
- Mixed precision with masters is unusual under DDP (torch AMP keeps fp32 weights;
  use ``--amp``); when asked for, the master copy and its fp32 gradient at the step are
  counted like any other engine's.
"""
from __future__ import annotations

from ..terms.model_states import PlanSpec, plan_spec
from ..terms.optimizers import step_temporary_bytes
from ..terms.precision import FP32_BYTES
from .base import EngineContext, EngineTerms, nonzero


class DistributedDataParallel:
    """DDP (``ddp``) and DDP + ZeroRedundancyOptimizer (``zero1``)."""

    name = "ddp"
    hybrid_stages: tuple[int, ...] = ()  # DDP and ZeroRedundancyOptimizer shard over the whole group
    plans = (plan_spec("ddp"), plan_spec("zero1"))

    def __init__(self, gradient_as_bucket_view: bool = False) -> None:
        self.gradient_as_bucket_view = gradient_as_bucket_view

    def terms(self, plan: PlanSpec, context: EngineContext) -> EngineTerms:
        policy, psi = context.policy, context.psi
        stepped = psi if plan.stage == 0 else min(psi, max(context.shard, context.largest_tensor))
        per_element = policy.master_bytes + context.state_bytes
        optimizer = per_element * stepped + context.factored_bytes(sharded=plan.stage > 0)
        wrapped = context.world_size > 1
        buckets = policy.grad_bytes * psi if wrapped and not self.gradient_as_bucket_view else 0
        state_dtype = FP32_BYTES if policy.mixed else policy.state_bytes
        return EngineTerms(
            params=policy.param_bytes * psi,
            grads=policy.grad_bytes * psi,
            optimizer_states=optimizer,
            grads_transient=not (wrapped and self.gradient_as_bucket_view),
            persistent=nonzero(ddp_gradient_buckets=buckets),
            step=nonzero(
                fp32_master_grads=FP32_BYTES * stepped if policy.mixed else 0,
                optimizer_step_temporaries=step_temporary_bytes(
                    context.optimizer, context.implementation, stepped, context.largest_tensor, state_dtype)))
