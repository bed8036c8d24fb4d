"""From what the user gave (a count, a config, a module) to model facts and an activation model."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from shardengine.engine_facts import find_units

from ..terms.activations import ActivationInputs, ActivationProfile, activation_profile
from ..engines.shardengine_exact import ExactShardEngineModel, EngineOptions, exact_engine_model
from ..errors import EstimatorInputError
from .hf_config import stats_from_config
from ..terms.kernels import loss_bytes
from .module import load_module, module_stats, traced_activations
from .traced_blocks import TracedActivations
from ..terms.optimizers import group_index_by_name
from ..plan.setup import TrainingSetup
from .stats import Architecture, ModelStats, check_count, stats_from_count

if TYPE_CHECKING:
    from ..allocator.trace import StepShape
    from ..request import ModelRequest


@dataclass(frozen=True)
class ActivationModel:
    """Activation bytes as a function of micro-batch; the logits term kept apart."""

    source: str                         # "analytic", "traced" or "not estimated"
    architecture: Architecture | None = None
    traced_bytes: int = 0
    traced_micro_batch: int = 1
    traced: TracedActivations | None = None  # the trace unit by unit: checkpointing and offload priced
    # parts whose activations no model covers (a vision tower; a whole non-transformer): each an
    # unbounded term of the verdict and a warning, never a silent 0
    unmodelled: tuple[str, ...] = ()

    def activations(self, micro_batch: int, setup: TrainingSetup) -> ActivationProfile:
        if self.source == "traced":
            # One trace at the requested micro-batch; other sizes scale linearly, as
            # every activation tensor has the batch as a dimension.
            if self.traced is not None:
                return self.traced.profile(setup.checkpointing, setup.activation_offload, micro_batch)
            return ActivationProfile(math.ceil(self.traced_bytes * micro_batch / self.traced_micro_batch))
        if self.architecture is None:
            return ActivationProfile(0)
        return activation_profile(self.architecture, self._inputs(micro_batch, setup))

    @staticmethod
    def _inputs(micro_batch: int, setup: TrainingSetup) -> ActivationInputs:
        policy = setup.policy
        return ActivationInputs(micro_batch, setup.seq_len, setup.checkpointing, setup.fused_attention,
                                fp32_activations=policy.activation_bytes == 4, autocast=policy.amp is not None,
                                kernels=setup.kernels, offload=setup.activation_offload)

    def step_shape(self, micro_batch: int, setup: TrainingSetup) -> "StepShape | None":
        """The shape-dependent tensors of a step, for the allocator's replay (analytic models only)."""
        if self.source != "analytic" or self.architecture is None or self.architecture.encoder is not None:
            return None  # the replay knows decoder stacks only
        from ..allocator.trace import StepShape
        return StepShape(self.architecture, self._inputs(micro_batch, setup), setup.loss, setup.loss_upcast is not False,
                         setup.logits_cast_bytes(self.architecture))

    def logits(self, micro_batch: int, setup: TrainingSetup) -> int:
        if self.source != "analytic" or self.architecture is None or not self.architecture.lm_head:
            return 0
        arch = self.architecture
        return loss_bytes(setup.loss, arch.vocab, arch.hidden, micro_batch, setup.seq_len,
                          setup.policy.activation_bytes, compiled=setup.compile,
                          upcast=setup.loss_upcast is not False or setup.policy.amp is not None,
                          cast=setup.logits_cast_bytes(arch), softcap=arch.logit_softcap)


def architecture_from_flags(hidden, layers, heads, vocab) -> Architecture | None:
    given = {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab}
    if all(value is None for value in given.values()):
        return None
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise EstimatorInputError(f"activations need hidden, layers, heads and vocab; missing {', '.join(missing)}")
    return Architecture(**{name: check_count(name, value) for name, value in given.items()})


def _with_largest_layer(stats: ModelStats, largest_layer) -> ModelStats:
    if largest_layer is None:
        return stats
    return replace(stats, largest_unit=check_count("largest layer", largest_layer, maximum=stats.params))


def model_facts(wanted: "ModelRequest", setup: TrainingSetup, engine_options: EngineOptions | None = None,
                optimizer: Any = None):
    """ModelStats, the activation model and (for a module) shardengine's exact accounting."""
    params, config, module, largest_layer = wanted.params, wanted.config, wanted.module, wanted.largest_layer
    architecture = architecture_from_flags(wanted.hidden, wanted.layers, wanted.heads, wanted.vocab)
    given = [name for name, value in (("params", params), ("config", config), ("module", module)) if value is not None]
    if len(given) != 1:
        raise EstimatorInputError("give exactly one of params, config or module"
                                  + (f" (got {', '.join(given)})" if given else "")
                                  + ": on the command line --params 7e9, --config config.json or "
                                    "--module pkg.mod:build_fn")
    if config is not None:
        stats = _with_largest_layer(stats_from_config(config), largest_layer)
        source = "analytic" if stats.architecture is not None else "not estimated"
        return stats, ActivationModel(source, stats.architecture, unmodelled=stats.unmodelled_activations), None
    if params is not None:
        stats = stats_from_count(params, largest_unit=largest_layer, architecture=architecture)
        return stats, ActivationModel("analytic" if architecture else "not estimated", architecture), None
    if setup.adapters is not None:
        raise EstimatorInputError("a module says itself what is frozen (requires_grad) and what its adapters are; "
                                  "--lora-rank, --trainable-params and --base-dtype apply to --params or --config")
    loaded = load_module(module, wanted.example_inputs)
    stats = _with_largest_layer(module_stats(loaded.module), largest_layer)
    exact = _exact_engine(loaded.module, module, setup, engine_options, optimizer)
    if loaded.example_inputs is None:
        if architecture is None:
            return stats, ActivationModel("not estimated"), exact
        return replace(stats, architecture=architecture), ActivationModel("analytic", architecture), exact
    wrap = engine_options or EngineOptions()
    find = lambda root: [unit for unit, _, _ in find_units(root, wrap.wrap, wrap.wrap_min_params)[:-1]]  # noqa: E731
    traced = traced_activations(loaded.module, loaded.example_inputs, setup.micro_batch, setup.seq_len,
                                _compute_dtype(setup), find)
    return stats, ActivationModel("traced", traced_bytes=traced.peak, traced_micro_batch=setup.micro_batch,
                                  traced=traced), exact


def _exact_engine(meta_module, source, setup: TrainingSetup, options: EngineOptions | None,
                  optimizer) -> ExactShardEngineModel:
    """Plan the (meta) module with shardengine's planner: exact bytes, padding included.

    A live optimizer's param groups split buckets as they do in the engine; its
    parameters are matched to the meta copy by name.
    """
    options = options or EngineOptions(bucket_mb=setup.bucket_bytes / 2**20, prefetch=setup.prefetch_depth,
                                       reshard_after_forward=setup.reshard_after_forward)
    group_of = None
    named_source = source if hasattr(source, "named_parameters") else meta_module
    by_name = group_index_by_name(optimizer, named_source)
    if by_name is not None:
        group_of = {id(p): by_name.get(name) for name, p in meta_module.named_parameters()}
    return exact_engine_model(meta_module, setup.world_size, options, group_of)


def _compute_dtype(setup: TrainingSetup):
    """The dtype a trace runs in: autocast's, else the weights' compute dtype."""
    import torch

    name = setup.amp or setup.precision.removeprefix("pure-")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
