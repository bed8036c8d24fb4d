"""PyTorch FSDP2 (``fully_shard``), one group per transformer block plus the root.

Sources: ``torch/distributed/fsdp/_fully_shard/`` (``_fully_shard.py``,
``_fsdp_api.py``, ``_fsdp_param_group.py``, ``_fsdp_state.py``).

- Sharded parameters are dim-0 DTensor shards in the parameters' *original* dtype, and
  the optimizer steps them directly: under ``MixedPrecisionPolicy(param_dtype=bf16)``
  there is no separate master — the fp32 shards are the masters ("FSDP does not
  require any extra memory to keep a high-precision copy", ``MixedPrecisionPolicy``'s
  docstring). So bf16 mixed precision holds 4 + 4 + K bytes per sharded element; a bf16
  model without a policy (pure bf16) 2 + 2 + K/2.
- Sharded gradients are created by each group's reduce-scatter and freed by
  ``zero_grad()``: transient.
- Unsharded parameters are all-gathered in ``param_dtype``. The root group is never
  resharded after forward (``_fsdp_state.py``: "For the root, do not reshard after
  forward"), so the embeddings and head stay gathered through the step. With implicit
  prefetching a group's all-gather output is kept until the next group's copy-in
  (``all_gather_state``) while the next group is gathered: the running group, its
  retained all-gather output and ``prefetch`` groups ahead.
- Backward reduce-scatters each group's unsharded gradients (``param_dtype``) from a
  flat input in ``reduce_dtype`` (default: ``param_dtype``); the previous group's
  reduce-scatter input is retained until the next one is issued
  (``reduce_scatter_states``).
- ``reshard_after_forward=False`` (the ``zero2`` plan, FSDP1's SHARD_GRAD_OP) keeps
  every group gathered from its forward to its backward: all of them at the end of
  forward.
- ``CPUOffloadPolicy`` (the ``zero3-offload-params`` plan) keeps sharded parameters,
  gradients and optimizer states in pinned host memory and steps there; the device
  holds the gathered groups and the gradient buffers only, plus each group's all-gather
  input on its way in: ``FSDPParam.all_gather_inputs`` copies the host shard to the device
  (``.to(device, non_blocking=True)``, the sharded dtype) and, under a mixed-precision
  policy, casts that copy to ``param_dtype`` before the copy-in (``offload_copy_buffers``,
  1/N of a group; the gathers are issued one after another, so one group's at a time).
"""
from __future__ import annotations

import math

from ..terms.model_states import PlanSpec, plan_spec
from ..terms.optimizers import step_temporary_bytes
from ..terms.precision import FP32_BYTES
from .base import EngineContext, EngineTerms, nonzero

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class FullyShard:
    """FSDP2 plans: ``zero2`` (no reshard after forward), ``zero3`` and CPU offload."""

    name = "fsdp2"
    hybrid_stages: tuple[int, ...] = (2, 3)  # a 2-D mesh (HSDP); no stage 1 to shard within groups
    plans = (plan_spec("zero2"), plan_spec("zero3"), plan_spec("zero3-offload-params"))

    def __init__(self, reduce_dtype: str | None = None) -> None:
        self.reduce_dtype = reduce_dtype

    def terms(self, plan: PlanSpec, context: EngineContext) -> EngineTerms:
        policy, shard = context.policy, context.shard
        sharded_bytes = FP32_BYTES if policy.mixed else policy.param_bytes  # the original dtype
        state_bytes = FP32_BYTES if policy.mixed else policy.state_bytes
        optimizer = context.fp32_state_bytes if policy.mixed else context.state_bytes
        params, grads = sharded_bytes * shard, sharded_bytes * shard
        states = optimizer * shard + context.factored_bytes(sharded=True)
        forward = self._gathered(plan, context)
        if plan.offload_params:
            forward = {**forward, **self._host_shard_copies(context, sharded_bytes)}
            return EngineTerms(0, 0, 0, grads_transient=True, forward=forward,
                               host=nonzero(params=params, grads=grads, optimizer_states=states))
        return EngineTerms(
            params, grads, states, grads_transient=True, forward=forward,
            step=nonzero(optimizer_step_temporaries=step_temporary_bytes(
                context.optimizer, context.implementation, shard,
                math.ceil(context.largest_tensor / context.world_size), state_bytes)))

    @staticmethod
    def _host_shard_copies(context: EngineContext, sharded_bytes: int) -> dict[str, int]:
        """CPU offload: one group's host shard copied to the device, and its cast when mixed."""
        cast = context.policy.param_bytes if context.policy.mixed else 0
        return nonzero(offload_copy_buffers=math.ceil((sharded_bytes + cast) * _group(context) / context.world_size))

    def _gathered(self, plan: PlanSpec, context: EngineContext) -> dict[str, int]:
        p = context.policy.param_bytes  # param_dtype: the unsharded parameters
        reduce = _DTYPE_BYTES[self.reduce_dtype] if self.reduce_dtype else p
        block = _group(context)
        root = context.stats.outside_params or 0
        if plan.name == "zero2":
            gathered = p * context.psi  # every group stays unsharded until its backward
        else:
            gathered = p * (root + (2 + context.prefetch) * block)
        return nonzero(all_gather_buffers=gathered,
                       reduce_scatter_buffers=(p + 2 * reduce) * block)


def _group(context: EngineContext) -> int:
    """Elements of one ``fully_shard`` group: a transformer block (or the largest unit)."""
    return context.stats.block_params or context.largest_unit
